"""Case study (paper Figure 14): the simulator's own wall time against the number of GPUs
and the trace size (DDP on a fat tree; the trace repeated to make it longer). Writes
simulator_speed.csv and simulator_speed.png (log-log).
Run: python -m case_studies.simulator_speed --out out/speed
"""

from __future__ import annotations

import argparse
import time

from case_studies.common import ROOT, out_dir, write_csv
from triosim.simulation.wiring import Simulation
from triosim.trace.files import load_any_trace


def repeated(trace, times: int):
    """The trace's forward and backward operators `times` over (a deeper model)."""
    import dataclasses

    from triosim.trace.model import Trace

    ops, next_id = [], 0
    for k in range(times):
        for op in trace.operators:
            if op.phase == "optimizer" and k < times - 1:
                continue
            ops.append(dataclasses.replace(op, id=next_id, fwd_id=None, layer=f"{k}.{op.layer}"))
            next_id += 1
    return Trace(ops, trace.tensors, dict(trace.metadata))


def study(gpu_counts=(2, 8, 32, 128), sizes=(1, 4, 16)) -> list[dict]:
    base = load_any_trace(ROOT / "traces" / "cpu" / "resnet18-b8.trace.json.gz")
    warm = {"num_gpus": 2, "batch_size": 16, "parallelism": {"mode": "ddp"}}
    Simulation(warm, trace=base).run()  # one-off imports and model fitting out of the timings
    rows = []
    for size in sizes:
        trace = repeated(base, size)
        for n in gpu_counts:
            cfg = {
                "num_gpus": n,
                "batch_size": 8 * n,
                "parallelism": {"mode": "ddp"},
                "topology": {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us"},
            }
            t0 = time.perf_counter()
            Simulation(cfg, trace=trace).run()
            rows.append(
                {"gpus": n, "operators": len(trace.operators), "wall_s": time.perf_counter() - t0}
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/speed")
    args = ap.parse_args(argv)
    folder = out_dir(args.out)
    rows = study()
    write_csv(folder / "simulator_speed.csv", rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for ops in dict.fromkeys(r["operators"] for r in rows):
        pts = [r for r in rows if r["operators"] == ops]
        ax.plot(
            [r["gpus"] for r in pts],
            [r["wall_s"] for r in pts],
            marker="o",
            label=f"{ops} operators",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("simulation wall time (s)")
    ax.set_title("Simulator speed: DDP on a fat tree (one 2-core machine)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "simulator_speed.png", dpi=110)
    plt.close(fig)
    for r in rows:
        print(f"{r['gpus']:>5} GPUs {r['operators']:>6} ops {r['wall_s']:>8.3f} s")
    print(f"wrote simulator_speed.csv and simulator_speed.png into {folder}")
    return rows


if __name__ == "__main__":
    main()
