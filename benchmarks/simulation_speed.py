"""Simulator wall time as the GPU count grows (the paper's Figure 14, in shape):
DDP on the shipped ResNet-18 trace over a fat tree, 2 to 256 GPUs: wall time, peak traced
Python memory (a separate run), tasks in the timeline.
Run: python benchmarks/simulation_speed.py
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

from triosim.simulation.wiring import Simulation, load_any_trace

ROOT = Path(__file__).resolve().parents[1]


def main():
    trace = load_any_trace(ROOT / "traces/cpu/resnet18-b8.trace.json.gz")
    print(f"{'GPUs':>5} {'wall s':>8} {'peak MB':>8} {'tasks':>8} {'iteration ms':>13}")
    for n in (2, 4, 8, 16, 32, 64, 128, 256):
        cfg = {
            "num_gpus": n,
            "batch_size": 8 * n,
            "parallelism": {"mode": "ddp"},
            "topology": {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us"},
        }
        t0 = time.perf_counter()
        r = Simulation(cfg, trace=trace).run()
        wall = time.perf_counter() - t0
        tracemalloc.start()  # a second run for memory: tracing slows Python several-fold
        Simulation(cfg, trace=trace).run()
        peak = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        print(
            f"{n:>5} {wall:>8.2f} {peak:>8.1f} {len(r.timeline):>8} {r.iteration_time * 1e3:>13.3f}"
        )


if __name__ == "__main__":
    main()
