"""The packet network's fast engine re-solves max-min fairness only on the connected
components (links joined by the flows crossing them) whose flows changed: disjoint
components starting and finishing at different times, components merged by a bridging
flow and split again when it leaves. Each scenario runs on both engines (the reference
solves the whole table every time) with the fast engine's `check_solves` on, which
compares every partial solve with a whole-table one, bit for bit; deliberately broken
component searches must fail those checks."""

import networkx as nx
import numpy as np
import pytest
import simpy

from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.packet.solve import ComponentSolve

# these tests read the solver's work on the flow table: every transfer goes there
pytestmark = pytest.mark.usefixtures("no_group_jobs")

GB = 1e9


class Logged(PacketSwitchNetwork):
    """Logs (time, flows in the table, flows re-solved) at every solve."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        solver = self._engine.solver
        solve = solver.solve_changed

        def logged():
            n = len(solver.table.rem)
            out = solve()
            self.log.append((self.env.now, n, solver.resolved))
            return out

        solver.solve_changed = logged


def _chain_graph():
    """0 -> 1 -> ... -> 11, one direction: a route is the stretch between its ends. Link
    1->2 is slow, 4->5 and 5->6 fast, so the rates of a component depend on its far end."""
    g = nx.DiGraph()
    for u in range(11):
        bw = 4 * GB if u == 1 else 20 * GB if u in (4, 5) else 10 * GB
        g.add_edge(u, u + 1, bandwidth=bw, latency=1e-6)
    for u in range(12):
        g.nodes[u]["kind"] = "gpu"
    return g


def _run(engine, graph, plan, check=True, cls=PacketSwitchNetwork):
    """plan: (start time, [transfers]) per call; every call is its own transfer group."""
    env = simpy.Environment()
    net = cls(env, graph, engine=engine)
    if engine == "fast":
        net.check_solves = check
        net.log = []
    ends = {}

    def call(k, t, transfers):
        yield env.timeout(t)
        evs = net.transfer_group(transfers, tag=str(k))
        yield env.all_of(evs)
        ends[k] = env.now

    for k, (t, transfers) in enumerate(plan):
        env.process(call(k, t, transfers))
    env.run()
    recs = sorted((r.tag, r.src, r.dst, r.nbytes, r.start, r.end) for r in net.records)
    links = net.link_stats()
    return ends, recs, links["bytes"].to_numpy(), links["busy_time"].to_numpy(), net


def _same(ref, fast):
    assert ref[0].keys() == fast[0].keys()
    for k in ref[0]:
        assert fast[0][k] == pytest.approx(ref[0][k], rel=1e-9, abs=0), k
    assert len(ref[1]) == len(fast[1])
    for r, f in zip(ref[1], fast[1], strict=True):
        assert r[:4] == f[:4]
        assert f[4:] == pytest.approx(r[4:], rel=1e-9, abs=0), (r, f)
    np.testing.assert_allclose(fast[2], ref[2], rtol=1e-12)
    np.testing.assert_allclose(fast[3], ref[3], rtol=1e-9, atol=1e-15)
    assert fast[4].max_utilisation == pytest.approx(ref[4].max_utilisation, rel=1e-12)


# A: 0->2 (4 GB/s, the slow link), E: 4->6 (20 GB/s) and three others alone start
# together; B: 3->5 joins E's component (B 10, E 10 on 4->5); C: 6->7 runs alone; D: 1->4
# bridges A and {B, E}: A and D share 1->2 (2 each), B takes the 8 D leaves on 3->4 and E
# the 12 B leaves on 4->5, though E crosses no link of D's. D leaves first and splits them.
MERGE_PLAN = [
    (0.0, [(0, 2, 4e8)]),  # A
    (0.0, [(4, 6, 6e8)]),  # E
    (0.0, [(8, 9, 2e8)]),
    (0.0, [(9, 11, 2e8)]),
    (0.0, [(7, 8, 2e8)]),
    (2e-3, [(3, 5, 5e8)]),  # B
    (3e-3, [(6, 7, 1e8)]),  # C
    (5e-3, [(1, 4, 2e7)]),  # D: the bridge
]


def test_merge_and_split_match_the_reference_and_the_whole_table():
    ref = _run("reference", _chain_graph(), MERGE_PLAN)
    fast = _run("fast", _chain_graph(), MERGE_PLAN, cls=Logged)
    _same(ref, fast)
    log = fast[4].log
    # B's start re-solves B and E; C's, C alone; D's, A, B, D and E of the 8 in flight
    assert [(n, r) for t, n, r in log if t == 2e-3] == [(6, 2)]
    assert [(n, r) for t, n, r in log if t == 3e-3] == [(7, 1)]
    assert [(n, r) for t, n, r in log if t == 5e-3] == [(8, 4)]
    # C leaves at 13 ms (its link empties: nothing to re-solve); D at 15 ms (10 ms at
    # 2 GB/s): A, B and E are re-solved, as two components, and the others kept
    d_end = fast[0][7]
    assert [(n, r) for t, n, r in log if 5e-3 < t <= d_end] == [(7, 0), (6, 3)]
    assert fast[4].component_solves > 0 and fast[4].alone_solves > 0


def _disjoint_plan(rng, n_gpus, calls):
    plan = []
    for _ in range(calls):
        t = float(rng.choice([0.0, 1e-4, 3e-4, float(rng.uniform(0, 1e-3))]))
        src, dst = (int(x) for x in rng.choice(n_gpus, 2, replace=False))
        size = float(rng.uniform(1e6, 5e7))
        cap = float(rng.uniform(2, 40)) * GB if rng.random() < 0.2 else None
        tr = (src, dst, size) + ((cap,) if cap else ())
        plan.append((t, [tr]))
    return plan


@pytest.mark.parametrize("seed", range(6))
def test_many_components_on_a_fat_tree(seed):
    # point-to-point transfers between random GPUs of a 32-GPU fat tree started at a few
    # instants: many small components (pairs under one leaf), some sharing up-links
    rng = np.random.default_rng(seed)
    g = topo.fat_tree(32, 25 * GB, 1e-6, radix=8)
    plan = _disjoint_plan(rng, 32, 40)
    ref = _run("reference", g, plan)
    fast = _run("fast", g, plan, cls=Logged)
    _same(ref, fast)
    assert any(r < n for _, n, r in fast[4].log)  # some solves were partial


def test_pipeline_sends_each_alone():
    # GPU k -> k+1 through a switch, 16 calls at one instant and 15 more later: the calls
    # of one instant are solved together, once, by the closed form for new flows each
    # alone on their links
    g = topo.switch_star(32, 40 * GB, 1e-6)
    plan = [(0.0, [(k, k + 1, 1e7 * (1 + k % 3))]) for k in range(0, 32, 2)]
    plan += [(4e-4, [(k, k + 1, 2e7)]) for k in range(1, 31, 2)]
    ref = _run("reference", g, plan)
    fast = _run("fast", g, plan, cls=Logged)
    _same(ref, fast)
    net = fast[4]
    at_starts = [(t, r) for t, _, r in net.log if t in (0.0, 4e-4) and r]
    assert at_starts == [(0.0, 16), (4e-4, 15)], net.log
    assert net.alone_solves >= 2 and net.component_solves == net.full_solves == 0


def test_infinite_links():
    # an infinitely fast link joins nothing (it never binds), and a flow over such links
    # only lands at once (a capped one runs at its cap)
    g = nx.DiGraph()
    for u, v, bw in [
        (0, 1, np.inf),
        (1, 2, 10 * GB),
        (2, 3, np.inf),
        (3, 4, 5 * GB),
        (4, 5, np.inf),
        (5, 6, 8 * GB),
    ]:
        g.add_edge(u, v, bandwidth=bw, latency=0.0)
    for u in range(7):
        g.nodes[u]["kind"] = "gpu"
    plan = [
        (0.0, [(0, 1, 1e6)]),
        (0.0, [(0, 3, 4e7)]),
        (1e-4, [(2, 3, 1e6)]),
        (1e-4, [(1, 2, 2e7)]),
        (2e-4, [(3, 4, 1e7, 2 * GB)]),
        (3e-4, [(4, 6, 1e7)]),
        (3e-4, [(4, 5, 1e7, 3 * GB)]),
        (3e-4, [(4, 5, 1e7)]),
    ]
    ref = _run("reference", g, plan)
    fast = _run("fast", g, plan)
    _same(ref, fast)


def _no_expansion(self, gone, new):
    """A broken component search: the new flows and the flows on their links only, not
    the rest of their components (and nothing for departures)."""
    t = self.table
    n = len(t.rem)
    dirty = np.zeros(n, bool)
    if new:
        mark = np.zeros(len(self.capacity), bool)
        tail = t.flat[len(t.flat) - int(t.nh[n - new :].sum()) :]
        mark[tail] = True
        dirty = np.logical_or.reduceat(mark[t.flat], np.cumsum(t.nh) - t.nh)
    return dirty, np.unique(t.flab[dirty & (t.flab >= 0)])


def test_a_component_search_that_stops_early_fails(monkeypatch):
    # D's start changes B's rate, hence E's (they share 4->5) though E is on no link D
    # crosses: a search that stops at D's links misses E
    monkeypatch.setattr(ComponentSolve, "_dirty", _no_expansion)
    with pytest.raises(AssertionError, match="whole table"):
        _run("fast", _chain_graph(), MERGE_PLAN)
    ref = _run("reference", _chain_graph(), MERGE_PLAN)
    with pytest.raises(AssertionError):
        _same(ref, _run("fast", _chain_graph(), MERGE_PLAN, check=False))


def test_skipping_a_touched_component_fails(monkeypatch):
    # no re-solve at all when the table only shrinks: the flows left keep stale rates
    real = ComponentSolve._dirty

    def lazy(self, gone, new):
        dirty, changed = real(self, gone, new)
        return (dirty, changed) if new else (np.zeros_like(dirty), changed[:0])

    monkeypatch.setattr(ComponentSolve, "_dirty", lazy)
    ref = _run("reference", _chain_graph(), MERGE_PLAN)
    with pytest.raises(AssertionError):
        _same(ref, _run("fast", _chain_graph(), MERGE_PLAN, check=False))


def test_alone_path_that_ignores_sharing_fails(monkeypatch):
    # a new flow taken as alone on links that carry others gets their whole capacity
    real = ComponentSolve._solve_alone

    def careless(self, seeds, new):
        occ = self.table.occ
        self.table.occ = np.minimum(occ, 1)
        try:
            return real(self, seeds, new)
        finally:
            self.table.occ = occ

    monkeypatch.setattr(ComponentSolve, "_solve_alone", careless)
    with pytest.raises(AssertionError, match="whole table"):
        _run("fast", _chain_graph(), MERGE_PLAN)
    ref = _run("reference", _chain_graph(), MERGE_PLAN)
    with pytest.raises(AssertionError):
        _same(ref, _run("fast", _chain_graph(), MERGE_PLAN, check=False))


def test_labels_that_split_a_component_fail(monkeypatch):
    # a label per flow, whatever they share: a later change re-solves part of a component
    def apart(self, idx, links):
        self.table.flab[idx] = self.labels + np.arange(len(idx))
        self.llab[links] = self.labels
        self.labels += len(idx)

    monkeypatch.setattr(ComponentSolve, "_relabel", apart)
    with pytest.raises(AssertionError):
        _run("fast", _chain_graph(), MERGE_PLAN)
    ref = _run("reference", _chain_graph(), MERGE_PLAN)
    with pytest.raises(AssertionError):
        _same(ref, _run("fast", _chain_graph(), MERGE_PLAN, check=False))


# four capped transfers sharing the chain's links, below their shares (rates = caps); one
# leaves early (nothing to re-solve), then an uncapped one joins their links
CAPPED_PLAN = [
    (0.0, [(0, 3, 2e7, 2 * GB), (1, 4, 3e7, 3 * GB), (2, 5, 4e7, 1.5 * GB), (3, 6, 1e6, 2 * GB)]),
    (2e-3, [(2, 4, 4e7)]),
]


def test_rate_capped_components_skip_the_rounds():
    ref = _run("reference", _chain_graph(), CAPPED_PLAN)
    fast = _run("fast", _chain_graph(), CAPPED_PLAN, cls=Logged)
    _same(ref, fast)
    net = fast[4]
    assert net.capped_solves >= 1 and net.capped_skips >= 1, (net.capped_solves, net.capped_skips)


def test_taking_caps_for_rates_when_a_link_binds_fails(monkeypatch):
    # the uncapped flow joining at 2 ms makes the caps no longer the rates
    def caps(self, idx, links):
        return self.table.maxr[idx].copy(), True

    monkeypatch.setattr(ComponentSolve, "_round_one", caps)
    with pytest.raises(AssertionError, match="whole table"):
        _run("fast", _chain_graph(), CAPPED_PLAN)
    ref = _run("reference", _chain_graph(), CAPPED_PLAN)
    with pytest.raises(AssertionError):
        _same(ref, _run("fast", _chain_graph(), CAPPED_PLAN, check=False))


def _textbook():
    """Links a->b 10, b->c 4, c->d 10 (bytes/s x 1e9); flows a->d, b->c, c->d: b->c binds
    the first two at 2, and c->d then gives the third the 8 left: two rounds."""
    g = nx.DiGraph()
    for u, v, bw in [(0, 1, 10 * GB), (1, 2, 4 * GB), (2, 3, 10 * GB), (3, 4, GB), (4, 5, 10 * GB)]:
        g.add_edge(u, v, bandwidth=bw, latency=0.0)
    for u in range(6):
        g.nodes[u]["kind"] = "gpu"
    return g


TEXTBOOK_PLAN = [
    (0.0, [(4, 5, 1e9)]),
    (1e-3, [(0, 3, 1e8), (1, 2, 1e8), (2, 3, 1e8)]),
    (2e-3, [(4, 5, 1e8)]),
]


def test_second_round_components_match():
    ref = _run("reference", _textbook(), TEXTBOOK_PLAN)
    fast = _run("fast", _textbook(), TEXTBOOK_PLAN)
    _same(ref, fast)
    assert fast[4].component_solves >= 1  # the first round did not freeze them all


def test_a_first_round_without_the_local_minimum_test_fails(monkeypatch):
    # freezing every flow at its tightest share gives c->d's flow 5 instead of 8
    def greedy(self, idx, links):
        share = self.capacity[links] / self.table.occ[links]
        nh = self.table.nh[idx]
        tight = np.minimum.reduceat(share, np.cumsum(nh) - nh)
        return np.minimum(tight, self.table.maxr[idx]), False

    monkeypatch.setattr(ComponentSolve, "_round_one", greedy)
    with pytest.raises(AssertionError, match="whole table"):
        _run("fast", _textbook(), TEXTBOOK_PLAN)
