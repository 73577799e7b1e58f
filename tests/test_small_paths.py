"""The packet engine's plain-Python paths for few flows (a tensor-parallel collective's
handful of flows is most of a symmetric LLM run's solves) against its numpy paths: the
same rates, labels, loads and done flows, bit for bit.

Two levels: the solver's steps on random flow tables (`_relabel`, `_round_one`, `_dirty`,
`update_loads`, the table's `entries`), each run both ways on copies of one state; and whole
random scenarios of the engine fuzzer (tests/test_engine_fuzz.py: contending collectives,
capped groups, pipeline-like sends) run with the small paths on and off, every record,
completion and link counter compared with ==.
"""

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from networks.groups import Group
from networks.packet.engine import FastEngine
from networks.packet.groupjobs import Alone
from networks.packet.solve import ComponentSolve
from networks.packet.table import FlowTable
from tests.test_engine_fuzz import _scenario


def _numpy_only(monkeypatch):
    """Every small path off: the numpy paths throughout."""
    monkeypatch.setattr(ComponentSolve, "small_flows", -1)
    monkeypatch.setattr(ComponentSolve, "small_table", -1)
    monkeypatch.setattr(FlowTable, "small_flows", -1)
    monkeypatch.setattr(FlowTable, "small_rows", -1)
    monkeypatch.setattr(FastEngine, "small_table", -1)
    monkeypatch.setattr(FastEngine, "small_adds", -1)
    monkeypatch.setattr(Alone, "small_flows", -1)


class _Net:
    check_solves = False
    max_utilisation = 0.0

    def __init__(self, capacity):
        self.capacity = capacity


def _state(seed: int, n_flows: int):
    """A solver over random flows on 12 links (two infinitely fast, two slow), each flow
    on 1-4 distinct links, some with a rate cap; no flow labelled yet."""
    rng = np.random.default_rng(seed)
    cap = rng.choice([10e9, 25e9, 40e9], 12)
    cap[[3, 7]] = np.inf
    cap[[1, 5]] = rng.uniform(1e9, 5e9, 2)
    table = FlowTable(cap)
    for f in range(n_flows):
        links = rng.choice(12, int(rng.integers(1, 5)), replace=False).astype(np.int64)
        maxr = np.array([rng.choice([np.inf, 2e9, 8e9])])
        g = Group([0], [1], np.array([float(rng.uniform(1e6, 1e8))]), maxr, 0.0, "")
        table.add(
            f,
            g,
            np.zeros(1, np.int64),
            g.nb.copy(),
            np.zeros(1),
            np.zeros(1),
            np.array([len(links)]),
            links,
        )
    table.take_rows()
    solver = ComponentSolve(_Net(cap), table, landing=None)
    return solver, rng


def _both(solver, call):
    """call(solver) on a copy with the small paths and on one without: both results and
    the copies."""
    a = copy.deepcopy(solver)
    got_small = call(a)
    b = copy.deepcopy(solver)
    with pytest.MonkeyPatch.context() as m:
        _numpy_only(m)
        got_numpy = call(b)
    return (got_small, a), (got_numpy, b)


def _same(x, y):
    if isinstance(x, tuple):
        assert isinstance(y, tuple) and len(x) == len(y)
        for u, v in zip(x, y, strict=True):
            _same(u, v)
    elif isinstance(x, np.ndarray):  # bit for bit (array_equal takes -0.0 for 0.0)
        y = np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), (x, y)
    else:
        assert x == y, (x, y)


SMALL = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SMALL
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 24))
def test_labels_and_first_round_match_numpy(seed, n):
    solver, rng = _state(seed, n)
    t = solver.table
    idx = np.sort(rng.choice(n, int(rng.integers(2, n + 1)), replace=False)).astype(np.int64)
    links = t.flat[t.entries(idx)]

    (one_s, a), (one_n, b) = _both(solver, lambda s: s._round_one(idx, links))
    assert (one_s is None) == (one_n is None)
    if one_s is not None:
        _same(one_s, one_n)

    (_, a), (_, b) = _both(solver, lambda s: s._relabel(idx, links))
    assert a.labels == b.labels
    _same(a.table.flab, b.table.flab)
    _same(a.llab, b.llab)


@SMALL
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), new=st.integers(0, 3))
def test_dirty_loads_and_entries_match_numpy(seed, n, new):
    solver, rng = _state(seed, n)
    t = solver.table
    new = min(new, n)
    solver._relabel(np.arange(n - new, dtype=np.int64), t.flat[t.entries(np.arange(n - new))])
    t.flab[n - new :] = -1  # the last `new` flows not yet seen by a solve
    t.rate[:] = rng.uniform(1e8, 1e10, n)
    gone = rng.integers(-1, solver.labels + 1, int(rng.integers(0, 4)))
    r_small, r_numpy = _both(solver, lambda s: s._dirty(gone, new))
    _same(r_small[0], r_numpy[0])

    touched = np.unique(rng.choice(12, int(rng.integers(1, 6)))).astype(np.int64)
    (_, a), (_, b) = _both(solver, lambda s: s.update_loads(touched))
    _same(a.load, b.load)
    assert a.net.max_utilisation == b.net.max_utilisation

    flows = np.sort(rng.choice(n, int(rng.integers(1, min(n, 8) + 1)), replace=False))
    e_small, e_numpy = _both(solver, lambda s: s.table.entries(flows))
    _same(e_small[0], e_numpy[0])


@SMALL
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 24), now=st.floats(0.0, 10.0))
def test_done_flows_match_numpy(seed, n, now):
    """The done rule on flows at its edges: bytes left at or just above 1e-9 of the size,
    time left at or just above the clock's resolution, no links, no rate, infinite rate."""
    solver, rng = _state(seed, n)
    t = solver.table
    tick = 1e-12 * max(now, 1e-9)
    t.nh[rng.random(n) < 0.1] = 0
    t.rate[:] = rng.choice([0.0, 1e9, 3e10, np.inf], n)
    edge = rng.integers(0, 5, n)
    t.rem[:] = np.where(edge == 0, 1e-9 * t.nb, t.rem)
    t.rem[:] = np.where(edge == 1, np.nextafter(1e-9 * t.nb, np.inf), t.rem)
    finite = np.isfinite(t.rate)
    t.rem[:] = np.where((edge == 2) & finite, t.rate * tick, t.rem)
    t.rem[:] = np.where((edge == 3) & finite, np.nextafter(t.rate * tick, np.inf), t.rem)
    engine = FastEngine.__new__(FastEngine)
    engine.table = t
    cand = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
    for sel in (slice(None), cand):
        small = engine._done(sel, tick)
        with pytest.MonkeyPatch.context() as m:
            _numpy_only(m)
            plain = engine._done(sel, tick)
        _same(small, plain)


@pytest.mark.no_cover
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), kind=st.integers(0, 7), capped=st.booleans())
def test_whole_scenarios_match_numpy_bit_for_bit(seed, kind, capped):
    small = _scenario("fast", seed, kind, capped=capped)
    with pytest.MonkeyPatch.context() as m:
        _numpy_only(m)
        plain = _scenario("fast", seed, kind, capped=capped)
    assert small[0] == plain[0]  # every action's completion instant
    assert small[1] == plain[1]  # every transfer's start and end
    assert np.array_equal(small[2], plain[2]) and np.array_equal(small[3], plain[3])
    assert small[4].max_utilisation == plain[4].max_utilisation


def test_the_small_paths_run_in_the_scenarios(monkeypatch):
    """The fuzzer's scenarios reach every small path (else the comparison above proves
    nothing about them)."""
    calls = {}

    def counted(cls, name):
        real = getattr(cls, name)

        def wrapper(self, *args):
            calls[name] = calls.get(name, 0) + 1
            return real(self, *args)

        monkeypatch.setattr(cls, name, wrapper)

    for name in ("_relabel_small", "_round_one_small", "_update_loads_small"):
        counted(ComponentSolve, name)
    for seed in range(8):
        for kind in range(8):
            _scenario("fast", seed, kind)
    assert all(
        calls.get(k, 0) > 0 for k in ("_relabel_small", "_round_one_small", "_update_loads_small")
    ), calls


def test_edges_a_review_found():
    """Two flows over 2,100 links each (more entries than the propagation labels exactly:
    numpy gives them one label, so must the small path), and loads asked for a link twice."""
    cap = np.full(4200, 10e9)
    table = FlowTable(cap)
    for f in range(2):
        links = np.arange(f * 2100, (f + 1) * 2100, dtype=np.int64)
        g = Group([0], [1], np.array([1e6]), np.array([np.inf]), 0.0, "")
        table.add(f, g, np.zeros(1, np.int64), g.nb.copy(), np.zeros(1), np.zeros(1),
                  np.array([2100]), links)  # fmt: skip
    table.take_rows()
    solver = ComponentSolve(_Net(cap), table, landing=None)
    idx = np.arange(2, dtype=np.int64)
    links = table.flat[table.entries(idx)]
    (_, a), (_, b) = _both(solver, lambda s: s._relabel(idx, links))
    assert a.labels == b.labels == 1
    _same(a.table.flab, b.table.flab)

    table.rate[:] = [3e9, 4e9]
    touched = np.array([5, 5, 2150], np.int64)
    (_, a), (_, b) = _both(solver, lambda s: s.update_loads(touched))
    _same(a.load, b.load)
    assert a.load[5] == 3e9 and a.load[2150] == 4e9


@SMALL
@given(seed=st.integers(0, 2**31 - 1), new=st.integers(0, 5))
def test_dirty_flows_of_many_departures(seed, new):
    """`_dirty` with hundreds of departed flows' labels in runs (an all-to-all's), on a
    table above the small size: the flows sharing a label with them, and the new ones."""
    rng = np.random.default_rng(seed)
    solver, _ = _state(seed, 80)
    t = solver.table
    t.flab[:] = rng.integers(0, 12, 80)
    t.flab[80 - new :] = -1
    solver.labels = 12
    gone = np.repeat(rng.integers(-1, 12, 9), rng.integers(1, 60, 9))  # runs, -1 included
    dirty, changed = solver._dirty(gone, new)
    want = sorted({int(x) for x in gone if x >= 0} | {
        int(solver.llab[link]) for link in t.flat[len(t.flat) - int(t.nh[80 - new :].sum()) :]
        if np.isfinite(solver.capacity[link]) and solver.llab[link] >= 0
    }) if new else sorted({int(x) for x in gone if x >= 0})  # fmt: skip
    assert changed.tolist() == want
    expect = np.isin(t.flab, want)
    expect[80 - new :] = True
    _same(dirty, expect)
