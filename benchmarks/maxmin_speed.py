"""How fast the max-min solvers are: per-solve wall time of the level-by-level solver
(`max_min_rates_by_level`, the previous `max_min_rates`), the local-minimum solver
(`max_min_rates`) and the incremental `MaxMin` after one flow departs.

Cases: synthetic incidences (a ring step, overlapping rings, random hops, independent
components), then every solve the packet engine makes in the two contention cases of
`benchmarks.sim_speed` (all-to-all on a 128-GPU fat tree, a random permutation on a
1,024-GPU 2D torus), captured and replayed. Times are the best of --repeat runs; the
largest relative difference between old and new rates is shown.

Run: PYTHONPATH=. python -m benchmarks.maxmin_speed [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from networks.maxmin import MaxMin, max_min_rates, max_min_rates_by_level

GB = 50e9


def _incidence(paths):
    rows = np.concatenate(paths).astype(np.int64)
    cols = np.repeat(np.arange(len(paths)), [len(p) for p in paths])
    return rows, cols


def ring_step(n=1024):
    return np.arange(n), np.arange(n), n, np.full(n, GB)


def overlapping_rings(n=16384, hops=8):
    # flow i crosses links i..i+hops-1 of one physical ring: 8 DP rings on one fabric
    rows = (np.arange(n)[:, None] + np.arange(hops)[None, :]) % n
    return rows.ravel(), np.repeat(np.arange(n), hops), n, np.full(n, GB)


def random_hops(n=1024, hops=4, seed=0):
    rng = np.random.default_rng(seed)
    paths = [rng.choice(n, size=hops, replace=False) for _ in range(n)]
    rows, cols = _incidence(paths)
    return rows, cols, n, rng.choice([12.5e9, 25e9, 50e9, 100e9], size=n)


def components(k=64, flows=256, hops=4, seed=0):
    # k independent blocks of `flows` links each; every flow stays inside its block
    rng = np.random.default_rng(seed)
    paths = [b * flows + rng.choice(flows, size=hops, replace=False)
             for b in range(k) for _ in range(flows)]  # fmt: skip
    rows, cols = _incidence(paths)
    return rows, cols, k * flows, rng.choice([12.5e9, 25e9, 50e9, 100e9], size=k * flows)


def _best(fn, repeat):
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _rel(a, b):
    fin = np.isfinite(b)
    assert (np.isinf(a) == np.isinf(b)).all()
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(a[fin] - b[fin]) / np.maximum(np.abs(b[fin]), 1e-300)))


def _incremental(rows, cols, n_flows, cap, repeat):
    """Best time of a MaxMin solve after flow 0 departs (then re-arrives: both timed)."""
    mm = MaxMin(cap)
    keys = np.arange(n_flows)
    mm.solve(rows, cols, keys)
    keep = cols != 0
    sub = (rows[keep], cols[keep] - 1, keys[1:])
    best, resolved = np.inf, 0
    for _ in range(repeat):
        for args in (sub, (rows, cols, keys)):
            t0 = time.perf_counter()
            got = mm.solve(*args)
            best = min(best, time.perf_counter() - t0)
            resolved = max(resolved, mm.resolved)
    full = max_min_rates(rows, cols, n_flows, cap)
    assert _rel(got, full) <= 1e-12
    return best, resolved


def capture(kind):
    """Every (rows, cols, n_flows, capacity) the fast engine solves in sim_speed's case."""
    import networks.packet as packet
    from benchmarks.sim_speed import traffic

    seen = []
    solver = packet.max_min_rates

    def spy(rows, cols, n_flows, capacity):
        seen.append((rows.copy(), cols.copy(), n_flows, capacity.copy()))
        return solver(rows, cols, n_flows, capacity)

    packet.max_min_rates = spy
    try:
        traffic(kind, "fast")
    finally:
        packet.max_min_rates = solver
    return seen


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    head = f"{'case':<34} {'flows':>6} {'entries':>8} {'old ms':>9} {'new ms':>9} {'x':>6}"
    print(head + f" {'incr ms':>8} {'resolved':>8} {'max rel diff':>12}")
    cases = [
        ("ring step 1,024 x 1", ring_step()),
        ("overlapping rings 16,384 x 8", overlapping_rings()),
        ("random 1,024 x 4", random_hops(1024)),
        ("random 16,384 x 4", random_hops(16384)),
        ("64 components x 256 x 4", components()),
    ]
    for name, case in cases:
        rows, cols, n_flows, cap = case
        old = _best(lambda c=case: max_min_rates_by_level(*c), a.repeat)
        new = _best(lambda c=case: max_min_rates(*c), a.repeat)
        inc, resolved = _incremental(rows, cols, n_flows, cap, a.repeat)
        diff = _rel(max_min_rates(rows, cols, n_flows, cap),
                    max_min_rates_by_level(rows, cols, n_flows, cap))  # fmt: skip
        print(f"{name:<34} {n_flows:>6} {len(rows):>8} {old * 1e3:>9.2f} {new * 1e3:>9.2f} "
              f"{old / new:>6.1f} {inc * 1e3:>8.2f} {resolved:>8} {diff:>12.1e}")  # fmt: skip
    for kind, label in (("all_to_all", "sim_speed all-to-all (all solves)"),
                        ("permutation", "sim_speed permutation (all solves)")):  # fmt: skip
        seen = capture(kind)
        old = _best(lambda s=seen: [max_min_rates_by_level(*x) for x in s], a.repeat)
        new = _best(lambda s=seen: [max_min_rates(*x) for x in s], a.repeat)
        diff = max(_rel(max_min_rates(*x), max_min_rates_by_level(*x)) for x in seen)
        flows = max(x[2] for x in seen)
        entries = max(len(x[0]) for x in seen)
        print(f"{label:<34} {flows:>6} {entries:>8} {old * 1e3:>9.1f} {new * 1e3:>9.1f} "
              f"{old / new:>6.1f} {'':>8} {len(seen):>8} {diff:>12.1e}")  # fmt: skip
    print("# old: max_min_rates_by_level; new: max_min_rates; incr: MaxMin.solve after one")
    print("# flow departs or arrives (resolved: flows re-solved); sim_speed rows: total ms over")
    print("# the run's solves (the resolved column there: number of solves)")


if __name__ == "__main__":
    main()
