"""Simulator speed against size, looking for cliffs (issue 47): DDP, FSDP and 3D on several
topology builders at N = 2, 4, 8, ... GPUs, each point one fresh process (its wall time:
loading, planning and simulating; its peak RSS), then per case the fitted exponent of wall
time against N (least squares in log-log over N >= 16) and every point more than 2x above
that curve named: a cliff. A PNG draws the curves.

Run: PYTHONPATH=. python benchmarks/speed_curve.py [--max 1024] [--cases ddp-ring,...]
     [--timeout 600] [--symmetry off|auto] [--out speed_curve.png]
The last line sums it up: the cases, the points, the cliffs.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESNET50 = str(ROOT / "traces" / "h100" / "resnet50-b128.trace.json.gz")
GPT2 = str(ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz")
RING = {"kind": "ring", "bandwidth": "65 GB/s", "latency": "1 us"}
NODES = {
    "kind": "multi_node",
    "gpus_per_node": 8,
    "bandwidth": "450 GB/s",
    "latency": "1 us",
    "inter_bandwidth": "50 GB/s",
    "inter_latency": "5 us",
}
FAT = {"kind": "fat_tree", "bandwidth": "50 GB/s", "latency": "1 us"}
SYMMETRY = ["off"]  # as users run by default; --symmetry auto for representatives


def _fat(n: int) -> dict:
    radix = 8
    while radix * radix // 2 < n:
        radix *= 2
    return {**FAT, "radix": radix}


def config(case: str, n: int) -> dict | None:
    """The config of `case` at n GPUs (None where the case has no form at n)."""
    mode, topo = case.split("-", 1)
    topology = {"ring": RING, "nodes": NODES, "fat": _fat(n)}[topo]
    if topo == "nodes" and n % 8:
        topology = {**NODES, "gpus_per_node": n}
    if mode == "ddp":
        return {
            "trace": RESNET50,
            "num_gpus": n,
            "batch_size": 128 * n,  # the traced batch on every GPU
            "parallelism": {"mode": "ddp"},
            "topology": topology,
            "symmetry": SYMMETRY[0],
        }
    if mode == "fsdp":
        return {
            "trace": GPT2,
            "num_gpus": n,
            "batch_size": 8 * n,
            "parallelism": {"mode": "fsdp"},
            "topology": topology,
            "symmetry": SYMMETRY[0],
        }
    if mode == "3d":  # tp 2 x pp 2, the rest data-parallel
        if n < 4:
            return None
        par = {"mode": "3d", "dp": n // 4, "tp": 2, "pp": 2, "microbatches": 4}
        return {
            "trace": GPT2,
            "num_gpus": n,
            "batch_size": 4 * (n // 4) * 2,
            "parallelism": par,
            "topology": topology,
            "symmetry": SYMMETRY[0],
        }
    raise ValueError(case)


ONE = """
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
t0 = time.perf_counter()
from triosim.simulation.wiring import Simulation
r = Simulation(json.loads(sys.argv[1])).run()
print(json.dumps({"wall": time.perf_counter() - t0, "it": r.iteration_time,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def point(cfg: dict, timeout: float) -> dict:
    try:
        p = subprocess.run(
            [sys.executable, "-c", ONE, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:g} s"}
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def cliffs(ns, walls) -> tuple[float, list]:
    """(the fitted exponent over N >= 16, the N whose wall is more than 2x the fit)."""
    pts = [(n, w) for n, w in zip(ns, walls, strict=True) if n >= 16 and w > 0]
    if len(pts) < 3:
        return math.nan, []
    x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    b, a = np.polyfit(x, y, 1)
    return float(b), [n for n, w in pts if w > 2 * math.exp(a + b * math.log(n))]


def tail_ratio(ns, walls) -> float:
    """Wall time of the largest N over that of the one before, per doubling of N (2.0: a
    linear tail; nan with fewer than two points)."""
    if len(ns) < 2 or walls[-2] <= 0:
        return math.nan
    return (walls[-1] / walls[-2]) ** (math.log(2) / math.log(ns[-1] / ns[-2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=1024, help="the largest N (default 1024)")
    ap.add_argument("--cases", default="ddp-ring,ddp-nodes,ddp-fat,fsdp-nodes,3d-nodes")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a point may take")
    ap.add_argument("--out", default="speed_curve.png", help="the figure")
    ap.add_argument("--symmetry", default="off", choices=("off", "auto"), help="default off")
    args = ap.parse_args(argv)
    SYMMETRY[0] = args.symmetry
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    sizes = [2**k for k in range(1, int(math.log2(args.max)) + 1)]
    results: dict = {}
    print(f"{'case':<12} {'N':>7} {'wall s':>8} {'RSS MB':>8} {'iteration ms':>13}")
    for case in cases:
        results[case] = []
        for n in sizes:
            cfg = config(case, n)
            if cfg is None:
                continue
            r = point(cfg, args.timeout)
            results[case].append((n, r))
            if "error" in r:
                print(f"{case:<12} {n:>7} {r['error']}")
                if r["error"].startswith("over"):
                    break  # larger ones take longer still
                continue
            print(
                f"{case:<12} {n:>7} {r['wall']:>8.2f} {r['rss'] / 1e6:>8.0f} {r['it'] * 1e3:>13.4f}"
            )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    found, total = [], 0
    for case, rows in results.items():
        ok = [(n, r) for n, r in rows if "error" not in r]
        total += len(ok)
        if not ok:
            continue
        ns, walls = [n for n, _ in ok], [r["wall"] for _, r in ok]
        k, bad = cliffs(ns, walls)
        found += [(case, n) for n in bad]
        last = tail_ratio(ns, walls)
        print(
            f"{case}: wall ~ N^{k:.2f} over N >= 16"
            + (f"; the last doubling {last:.2f}x" if last == last else "")
            + (f"; cliffs at N = {bad}" if bad else "")
        )
        (line,) = a1.loglog(ns, walls, "o-", label=case)
        if bad:  # the named points ringed in red
            a1.loglog(bad, [w for n, w in zip(ns, walls, strict=True) if n in bad], "o",
                      ms=13, mfc="none", mec="red", mew=1.5)  # fmt: skip
        a2.loglog(ns, [r["rss"] / 1e6 for _, r in ok], "o-", color=line.get_color(), label=case)
    a1.set(xlabel="GPUs", ylabel="wall s (one process)", title="time (red rings: named cliffs)")
    a2.set(xlabel="GPUs", ylabel="peak RSS MB", title="memory")
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(
        f"{len(cases)} cases, {total} points up to N = {args.max}, {len(found)} cliffs"
        + (f": {found}" if found else "")
        + f"; figure {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
