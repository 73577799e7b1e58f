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
    paths = [
        b * flows + rng.choice(flows, size=hops, replace=False)
        for b in range(k)
        for _ in range(flows)
    ]
    rows, cols = _incidence(paths)
    return rows, cols, k * flows, rng.choice([12.5e9, 25e9, 50e9, 100e9], size=k * flows)


def chain(n=256):
    # flow k crosses links k and k+1, capacities rising: each level waits on the one below,
    # so both solvers need one round per level (the new solver's worst case)
    rows = np.stack([np.arange(n), np.arange(1, n + 1)], axis=1).ravel()
    return rows, np.repeat(np.arange(n), 2), n, 1.0 + np.arange(n + 1.0)


def permutation_paths():
    """Routes of sim_speed's permutation case: 1,024 GPUs on a 32 x 32 torus."""
    import simpy

    from networks import PacketSwitchNetwork
    from networks import topology as topo

    rng = np.random.default_rng(0)
    perm = rng.permutation(1024)
    while (perm == np.arange(1024)).any():
        perm = rng.permutation(1024)
    net = PacketSwitchNetwork(simpy.Environment(), topo.torus2d(32, 32, GB, 1e-6))
    paths = [np.asarray(net.path_links(i, int(perm[i])), np.int64) for i in range(1024)]
    return paths, np.full(1024, 100e6), net.capacity


def staggered_components(k=16, flows=128, hops=4, seed=0):
    """components(): every flow with its own size, so departures are spread in time."""
    rows, cols, n_flows, cap = components(k, flows, hops, seed)
    paths = np.split(rows, np.cumsum(np.bincount(cols, minlength=n_flows))[:-1])
    return paths, np.random.default_rng(seed).uniform(1e6, 1e8, n_flows), cap


def fluid(paths, nbytes, cap, incremental):
    """A bare flow loop: solve, advance to the next finish, retire, repeat. Returns the
    finish time of every flow and the number of solves."""
    nh = np.array([len(p) for p in paths])
    flat = np.concatenate(paths)
    rem, alive, end = nbytes.astype(float), np.ones(len(paths), bool), np.zeros(len(paths))
    mm, now, solves = MaxMin(cap), 0.0, 0
    while alive.any():
        idx = np.flatnonzero(alive)
        rows = flat[np.repeat(alive, nh)]
        cols = np.repeat(np.arange(len(idx)), nh[idx])
        if incremental:
            rates = mm.solve(rows, cols, idx)  # a flow's index is its stable key
        else:
            rates = max_min_rates(rows, cols, len(idx), cap)
        solves += 1
        dt = float((rem[idx] / rates).min())
        now += dt
        rem[idx] -= rates * dt
        done = idx[rem[idx] <= 1e-12 * nbytes[idx]]
        end[done], alive[done] = now, False
    return end, solves


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
    from benchmarks.sim_speed import traffic
    from networks.packet import above as packet_above
    from networks.packet import solve as packet_solve

    seen = []
    solver = max_min_rates
    modules = (packet_solve, packet_above)  # where the fast engine calls the solver

    def spy(rows, cols, n_flows, capacity):
        seen.append((rows.copy(), cols.copy(), n_flows, capacity.copy()))
        return solver(rows, cols, n_flows, capacity)

    for module in modules:
        module.max_min_rates = spy
    try:
        traffic(kind, "fast")
    finally:
        for module in modules:
            module.max_min_rates = solver
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
        ("chain of 256 levels", chain(256)),
        ("chain of 1,024 levels", chain(1024)),
    ]
    for name, case in cases:
        rows, cols, n_flows, cap = case
        old = _best(lambda c=case: max_min_rates_by_level(*c), a.repeat)
        new = _best(lambda c=case: max_min_rates(*c), a.repeat)
        inc, resolved = _incremental(rows, cols, n_flows, cap, a.repeat)
        diff = _rel(
            max_min_rates(rows, cols, n_flows, cap),
            max_min_rates_by_level(rows, cols, n_flows, cap),
        )
        print(
            f"{name:<34} {n_flows:>6} {len(rows):>8} {old * 1e3:>9.2f} {new * 1e3:>9.2f} "
            f"{old / new:>6.1f} {inc * 1e3:>8.2f} {resolved:>8} {diff:>12.1e}"
        )
    for kind, label in (
        ("all_to_all", "sim_speed all-to-all (all solves)"),
        ("permutation", "sim_speed permutation (all solves)"),
    ):
        seen = capture(kind)
        old = _best(lambda s=seen: [max_min_rates_by_level(*x) for x in s], a.repeat)
        new = _best(lambda s=seen: [max_min_rates(*x) for x in s], a.repeat)
        diff = max(_rel(max_min_rates(*x), max_min_rates_by_level(*x)) for x in seen)
        flows = max(x[2] for x in seen)
        entries = max(len(x[0]) for x in seen)
        print(
            f"{label:<34} {flows:>6} {entries:>8} {old * 1e3:>9.1f} {new * 1e3:>9.1f} "
            f"{old / new:>6.1f} {'':>8} {len(seen):>8} {diff:>12.1e}"
        )
    for label, (paths, nbytes, cap) in (
        ("fluid loop: permutation torus", permutation_paths()),
        ("fluid loop: 16 staggered comps", staggered_components()),
    ):
        full = _best(lambda p=paths, b=nbytes, c=cap: fluid(p, b, c, False), max(1, a.repeat // 2))
        inc = _best(lambda p=paths, b=nbytes, c=cap: fluid(p, b, c, True), max(1, a.repeat // 2))
        end_full, solves = fluid(paths, nbytes, cap, False)
        end_inc, _ = fluid(paths, nbytes, cap, True)
        diff = _rel(end_inc, end_full)
        print(
            f"{label:<34} {len(paths):>6} {sum(map(len, paths)):>8} {'':>9} {full * 1e3:>9.1f} "
            f"{'':>6} {inc * 1e3:>8.1f} {solves:>8} {diff:>12.1e}"
        )
    print("# old: max_min_rates_by_level; new: max_min_rates; incr: MaxMin.solve after one")
    print("# flow departs or arrives (resolved: flows re-solved); sim_speed rows: total ms over")
    print("# the run's solves (the resolved column there: number of solves); fluid loop rows:")
    print("# whole loop with max_min_rates (new) or MaxMin (incr), max rel diff of finish times")


if __name__ == "__main__":
    main()
