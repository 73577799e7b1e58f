"""Case study (paper section 7.2, Figure 16b): Hop on 8 A100-class GPUs with random
bandwidth slow-downs; the speed-up one backup worker gives over none.

Each of 8 scenarios slows every GPU's links by a factor drawn uniformly from 1 to 10
(seed = scenario number). Two communication graphs (Figure 16a): ring-based (a ring plus a
chord to the most distant GPU) and double-ring (two ring-based graphs of 4 joined node to
node); the graph is also the physical topology, 100 GB/s per link and direction before
slow-down (an A100's 300 GB/s of NVLink over its 3 neighbours). VGG-11, batch 128 per worker,
20 iterations (time to finish all of them). Writes hop.csv and hop.png into --out.
Run: python case_studies/hop_heterogeneous.py --out out/hop
"""

from __future__ import annotations

import argparse

from case_studies.common import find_trace, grouped_bars, out_dir, write_csv
from triosim.simulation.wiring import Simulation

GRAPHS = {"ring-based": "ring_chord", "double-ring": "double_ring"}


def scenario_time(
    trace: str,
    graph: str,
    seed: int,
    backup: int,
    iterations: int,
    bandwidth: str = "100 GB/s",
    batch: int = 128,
) -> float:
    cfg = {
        "trace": trace,
        "num_gpus": 8,
        "batch_size": 8 * batch,
        "gpu": None,
        "iterations": iterations,
        "seed": seed,
        "parallelism": {"mode": "hop", "backup_workers": backup},
        "topology": {"kind": graph, "bandwidth": bandwidth, "latency": "1 us"},
        "heterogeneity": {"random": [{"target": "bandwidth", "low": 1, "high": 10}]},
    }
    return Simulation(cfg).run().total_time


def study(trace: str, scenarios: int = 8, iterations: int = 20, batch: int = 128) -> list[dict]:
    rows = []
    for seed in range(scenarios):
        for label, graph in GRAPHS.items():
            t0 = scenario_time(trace, graph, seed, 0, iterations, batch=batch)
            t1 = scenario_time(trace, graph, seed, 1, iterations, batch=batch)
            rows.append(
                {
                    "scenario": seed,
                    "graph": label,
                    "time_no_backup_s": t0,
                    "time_one_backup_s": t1,
                    "speedup": t0 / t1,
                }
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/hop", help="folder for hop.csv and hop.png")
    ap.add_argument("--scenarios", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args(argv)
    trace, source = find_trace("vgg11", "A100")
    folder = out_dir(args.out)
    rows = study(trace, args.scenarios, args.iterations)
    write_csv(folder / "hop.csv", rows)
    print(f"{'scenario':>8} {'graph':<12} {'no backup s':>12} {'1 backup s':>11} {'speed-up':>9}")
    for r in rows:
        print(
            f"{r['scenario']:>8} {r['graph']:<12} {r['time_no_backup_s']:>12.4f} "
            f"{r['time_one_backup_s']:>11.4f} {r['speedup']:>9.3f}"
        )
    series = {label: [r["speedup"] for r in rows if r["graph"] == label] for label in GRAPHS}
    grouped_bars(
        folder / "hop.png",
        [f"group {s + 1}" for s in range(args.scenarios)],
        series,
        "speed-up of 1 backup worker",
        "Hop on 8 GPUs, random bandwidth slow-downs (1-10x)",
        note=f"VGG-11, {args.iterations} iterations; {source}",
        baseline=1.0,
    )
    print(f"wrote {folder / 'hop.csv'} and {folder / 'hop.png'} ({source})")
    return rows


if __name__ == "__main__":
    main()
