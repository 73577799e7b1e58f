"""The symmetric run's collective path without a process per call (Meetings ->
Nccl.start_many -> Network.transfer_all_then): the same results as the general per-group
computation, and the exact helpers it rests on (sequential sums, events at an absolute
instant)."""

import functools
import operator
import types

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.same_results import NODES  # 4-GPU nodes, NVLink and a network
from extrapolators.communication.nccl import many as nccl_many
from extrapolators.communication.nccl import model as nccl_model
from networks import PacketSwitchNetwork
from networks import topology as topo
from networks.groups import fire_at, seq_sum
from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation


def _symmetric(par, n):
    t = chain_trace(batch=8, layers=4, weight_bytes=3e6)
    cfg = {
        "num_gpus": n,
        "batch_size": 8 * n,
        "parallelism": {"mode": "mesh", **par},
        "topology": NODES,
        "symmetry": "auto",
    }
    sim = Simulation(cfg, trace=t)
    r = sim.run()
    return r, pd.util.hash_pandas_object(r.timeline, index=False).to_numpy()


@pytest.mark.parametrize(
    "par",
    [
        {"tp": 4, "dp_shard": 4},
        {"tp": 2, "dp_shard": 2, "pp": 2, "microbatches": 2, "dp_replicate": 2},
        {"tp": 4, "dp_replicate": 4, "sequence_parallel": True},
    ],
)
def test_every_group_ending_as_the_first_gives_the_per_group_result(par, monkeypatch):
    """Where every copy's group lands with the first (`_uniform`), its end is taken once:
    the same iteration and the same timeline as computing every group's end."""
    taken = []
    real = nccl_many._uniform_ends

    def counted(*args):
        taken.append(1)
        return real(*args)

    monkeypatch.setattr(nccl_many, "_uniform_ends", counted)
    fast, fast_rows = _symmetric(par, 16)
    assert "representative" in fast.symmetry and taken
    monkeypatch.setattr(nccl_many, "_uniform", lambda *a: 0)
    slow, slow_rows = _symmetric(par, 16)
    assert repr(fast.iteration_time) == repr(slow.iteration_time)
    assert np.array_equal(fast_rows, slow_rows)


def test_uniform_needs_the_same_kept_flows_latencies_and_latency_after():
    # 3 groups of 2 streams; expand: each stream's kept flow
    b = types.SimpleNamespace(expand=np.array([0, 1, 1, 0, 0, 1]))
    two, lat = np.array([2, 2, 2]), np.array([1e-6, 2e-6, 2e-6, 1e-6, 1e-6, 2e-6])
    rest = np.full(3, 5e-6)
    assert nccl_many._uniform(b, two, rest, lat) == 2  # the same pairs, in any order
    other = types.SimpleNamespace(expand=np.array([0, 1, 1, 0, 0, 0]))
    assert nccl_many._uniform(other, two, rest, lat) == 0  # a group on another flow
    lat2 = lat.copy()
    lat2[5] = 3e-6
    assert nccl_many._uniform(b, two, rest, lat2) == 0  # another path latency
    assert nccl_many._uniform(b, two, np.array([5e-6, 5e-6, 6e-6]), lat) == 0
    uneven = types.SimpleNamespace(expand=np.array([0, 1, 1, 0, 0, 1]))
    assert nccl_many._uniform(uneven, np.array([2, 3, 1]), rest, lat) == 0
    assert nccl_many._uniform(types.SimpleNamespace(), two, rest, lat) == 0  # no orbits


def test_a_group_behind_a_slower_link_is_not_taken_as_the_first():
    """`_uniform` needs the copies' streams to be the same kept flows: without orbits
    (every flow moved) it says 0, and run_many still ends each group as its own."""
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.switch_star(8, 50e9, 1e-6))
    batch = net.batch([(0, 1, 1e6), (1, 0, 1e6), (2, 3, 1e6), (3, 2, 1e6)])
    counts = np.array([2, 2])
    assert nccl_many._uniform(batch, counts, np.zeros(2), np.zeros(4)) == 0


@settings(max_examples=200, deadline=None)
@given(
    acc=st.floats(-1e12, 1e12, allow_nan=False),
    values=st.lists(st.floats(-1e12, 1e12, allow_nan=False), max_size=70),
)
def test_seq_sum_adds_left_to_right(acc, values):
    # the definition: one add at a time, in order (not numpy's pairwise sum)
    assert seq_sum(acc, values) == functools.reduce(operator.add, values, acc)


def test_seq_sum_differs_from_a_pairwise_sum():
    # 1 + 1e-16 + ... : one add at a time loses every tiny term, pairwise sums keep some
    values = [1.0] + [1e-16] * 40
    assert seq_sum(0.0, values) == 1.0 and float(np.sum(values)) != 1.0


def test_fire_at_processes_the_event_at_the_instant_given():
    env = simpy.Environment()
    seen = []

    def proc():
        yield env.timeout(0.177)
        ev = env.event()
        ev.callbacks.append(lambda _e: seen.append(env.now))
        fire_at(env, ev, 0.761)  # a timeout(0.761 - 0.177) would fire at 0.7610000000000001
        now = env.event()
        now.callbacks.append(lambda _e: seen.append(env.now))
        fire_at(env, now, 0.177)

    env.process(proc())
    env.run()
    assert seen == [0.177, 0.761] and 0.177 + (0.761 - 0.177) != 0.761


def test_a_calls_plans_are_found_again_by_its_lists(monkeypatch):
    """`ManyCalls.plans` finds a call again by the identity of its lists (groups, roots), and
    by their groups' identities otherwise; it makes them again after `forget_batches`,
    and keeps no more GPU slots than MANY_SLOTS by its lists."""
    from tests.test_symmetry import _nccl_on

    env, model = _nccl_on({"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"}, 8)
    made = []
    many = model.many
    real = many._prepared
    monkeypatch.setattr(many, "_prepared", lambda *a: made.append(1) or real(*a))
    groups, roots = [(0, 1), (2, 3)], [None, None]
    a = many.plans("allreduce", groups, 8e6, roots, None)
    assert many.plans("allreduce", groups, 8e6, roots, None) is a and len(made) == 1
    other = list(groups)  # new lists of the same groups: found by the groups
    assert many.plans("allreduce", other, 8e6, [None, None], None) is a
    assert len(made) == 1
    model.forget_batches()
    b = many.plans("allreduce", groups, 8e6, roots, None)
    assert b is not a and len(made) == 2
    monkeypatch.setattr(many, "MANY_SLOTS", 6)  # two calls of 4 slots: the first goes
    many.plans("allreduce", [(4, 5), (6, 7)], 8e6, roots, None)
    assert many.same_slots == 4 and len(many.same_lists) == 1


def test_large_plans_keep_their_batches_within_a_budget(monkeypatch):
    """A plan of more than KEEP_BATCH streams keeps its routed batch while the kept large
    batches' streams stay within KEEP_STREAMS (the first met are kept); forget_batches
    frees the budget; and a run is the same, bit for bit, with none kept."""
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(8, 10e9, 1e-6))
    model = nccl_model.Nccl(env, net, gpu="H100-SXM")
    monkeypatch.setattr(model, "KEEP_BATCH", 4)
    monkeypatch.setattr(model, "KEEP_STREAMS", 20)
    plans = [model.plan("allreduce", tuple(range(8)), x) for x in (1e6, 2e6, 3e6)]
    sizes = [len(p.streams) for p in plans]
    assert all(n > 4 for n in sizes)
    for p in plans:
        model._batch_of(p)
    kept = [p.batch is not None for p in plans]
    budget, want = 20, []
    for n in sizes:  # the first ones met while they fit
        want.append(n <= budget)
        budget -= n if n <= budget else 0
    assert kept == want and any(kept)
    assert model._batch_of(plans[0]) is plans[0].batch  # found again, not routed again
    model.forget_batches()
    assert all(p.batch is None for p in plans) and model._big_kept == 0

    par = {"dp_shard": 16}
    monkeypatch.setattr(nccl_model.Nccl, "KEEP_BATCH", 4)  # every plan a large one
    models, init = [], nccl_model.Nccl.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        models.append(self)

    monkeypatch.setattr(nccl_model.Nccl, "__init__", record)
    kept_run = _symmetric(par, 16)
    assert models[-1]._big_kept > 0  # large batches were kept and found again
    monkeypatch.setattr(nccl_model.Nccl, "KEEP_STREAMS", 0)
    routed_run = _symmetric(par, 16)
    assert (kept_run[1] == routed_run[1]).all()
    assert kept_run[0].iteration_time == routed_run[0].iteration_time


def test_uneven_all_to_all_bytes_count_each_tables_own_mean():
    """`collective_bytes` of an uneven all-to-all: its table's mean bytes per GPU, added
    call by call; the mean is kept by the table's object, so a second table is its own."""
    from extrapolators.execution.meetings import Meetings
    from extrapolators.execution.tasks import Collective

    rt = types.SimpleNamespace(env=simpy.Environment(), comm=None, symmetry=None)
    rt.collective_bytes = {}
    m = Meetings(rt)
    a = ((0.0, 4.0), (2.0, 0.0))  # 6 bytes over 2 GPUs: 3 each
    b = ((0.0, 10.0), (30.0, 0.0))  # 20 each
    for sizes in (a, a, b, a):
        m._count(Collective("all_to_all", (0, 1), 0.0, "k", sizes=sizes))
    assert rt.collective_bytes == {"all_to_all": 3.0 + 3.0 + 20.0 + 3.0}


def test_a_landed_group_keeps_its_transfers_not_what_waited_on_it():
    """The network's log keeps every transfer group to the end of the run (its records);
    what waited on a group (its event, the callbacks' closures) goes once it has landed.
    Kept, a 1,024-GPU run's collectives left a million objects (a closure, its cells, the
    collective, its event) for every garbage collection to walk."""
    import gc
    import weakref

    from networks.groups import Then

    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.switch_star(4, 100e9, 1e-6))

    class Waiter:
        pass

    w = Waiter()
    gone = weakref.ref(w)
    seen = []
    net.transfer_all_then(net.batch([(0, 1, 1e6), (1, 2, 2e6)]), lambda rec, w=w: seen.append(1))
    ev = net.transfer_all([(2, 3, 1e6)])
    del w
    env.run()
    assert seen == [1] and len(ev.value) == 1
    assert gone() is None  # (freed when its group landed: no collection needed)
    assert sorted(net.transfers()["nbytes"]) == [1e6, 1e6, 2e6]  # the records stay
    # a symmetric run (its collectives by orbits, through Quotient): no waiter left (none
    # more than before it: another test's network may still be alive in this process)
    gc.collect()
    before = sum(type(o) is Then for o in gc.get_objects())
    r, _ = _symmetric({"tp": 4, "dp_shard": 4}, 16)  # (its result holds the log)
    gc.collect()
    assert r.transfers is not None and "representative" in r.symmetry
    assert sum(type(o) is Then for o in gc.get_objects()) <= before
