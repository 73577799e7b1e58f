"""Compute slowed while its GPU communicates (extrapolators/execution/contention.py): the
runtime's spans by hand, the time they lose against the overlap they had, and the section."""

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.communication.base import Textbook
from extrapolators.execution import Runtime
from extrapolators.execution.contention import PUBLISHED_SLOWDOWN, Contention, Span
from extrapolators.execution.tasks import Collective, Compute, ComputeRun, Recv, Send
from networks import PacketSwitchNetwork
from networks import topology as topo
from tests.conftest import chain_trace
from triosim.common.errors import ConfigError
from triosim.simulation.wiring import Simulation

MS = 1e-3


def runtime(slowdown, streams):
    """Two GPUs on a 1 GB/s ring without latency (1 MB: 1 ms); `streams`: (gpu, name,
    tasks). Returns the compute rows as (name, start, end)."""
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(2, 1e9, latency=0))
    rt = Runtime(env, net, Textbook(env, net), contention=Contention(env, slowdown))
    for gpu, name, tasks in streams:
        rt.start(gpu, name, tasks)
    env.run()
    rt.check_finished()
    return [(r[3], r[6], r[7]) for r in rt.rows if r[2] == "compute" and r[0] == 0]


def op(name, ms):
    return Compute(name, "l", "forward", ms * MS, 0, 0)


@pytest.mark.parametrize("shape", ["one block", "plain computes", "a mix"])
def test_a_send_beside_a_run_of_computes_by_hand(shape):
    """GPU 0 sends 1 MB (0 to 1 ms) beside two 1 ms operators, 25 % slower while it
    sends: by 1 ms the first has done 0.8 ms of its work, the rest (0.2 ms) at full speed:
    it ends at 1.2 ms, the second at 2.2 ms. Without contention: 1 and 2 ms. The same as
    one ComputeRun (timed inline), as plain Computes and as a mix (the runtime's other
    two paths)."""
    run = {
        "one block": [ComputeRun([op("a", 1), op("b", 1)])],
        "plain computes": [op("a", 1), op("b", 1)],
        "a mix": [op("a", 1), ComputeRun([op("b", 1)])],
    }[shape]
    tasks = [
        (0, "comm", [Send(1, 1e6, "k")]),
        (0, "compute", run),
        (1, "compute", [Recv(0, "k")]),
    ]
    rows = runtime(0.25, tasks)
    assert rows == [
        ("a", 0, pytest.approx(1.2 * MS, rel=1e-12)),
        ("b", pytest.approx(1.2 * MS, rel=1e-12), pytest.approx(2.2 * MS, rel=1e-12)),
    ]


def test_a_plain_compute_that_starts_while_its_gpu_communicates():
    """GPU 0 sends 2 MB (0 to 2 ms); its compute stream waits for GPU 1's 1 MB (0 to 1 ms),
    then runs 2 ms of work at 1 / 1.5 until 2 ms (0.6667 ms done) and the rest, 1.3333 ms,
    alone: it ends at 3.3333 ms."""
    tasks = [
        (0, "comm", [Send(1, 2e6, "out")]),
        (0, "compute", [Recv(1, "in"), op("a", 2)]),
        (1, "comm", [Send(0, 1e6, "in")]),
        (1, "compute", [Recv(0, "out")]),
    ]
    ((name, t0, t1),) = runtime(0.5, tasks)
    assert (t0, t1) == pytest.approx((1 * MS, (2 + 2 - 1 / 1.5) * MS), rel=1e-12)


def test_two_collectives_at_once_slow_compute_once():
    """Two all-gathers of 2 MB buffers over both GPUs at once on two comm streams (each
    GPU sends its 1 MB half: 1 ms alone, 2 ms together on the 1 GB/s ring) beside a 3 ms
    operator, 25 % slower: slowed for the 2 ms, not twice: 2 / 1.25 = 1.6 ms of work, the
    last 1.4 ms alone: 3.4 ms (3.2 at 1.25 x 1.25)."""
    streams = []
    for gpu in (0, 1):
        for k in ("x", "y"):
            streams.append((gpu, k, [Collective("all_gather", (0, 1), 2e6, k)]))
        streams.append((gpu, "compute", [op("a", 3)]))
    ((_, t0, t1),) = runtime(0.25, streams)
    assert (t0, t1) == pytest.approx((0, 3.4 * MS), rel=1e-12)


def test_computes_that_overlap_nothing_end_where_they_would_without_contention():
    """A send, then computes on the same stream (nothing overlaps them): every instant is
    the one the runtime gives without contention, to the last bit."""
    tasks = [
        (0, "compute", [Send(1, 3e5, "k"), ComputeRun([op("a", 0.1), op("b", 0.2)]), op("c", 0.7)]),
        (1, "compute", [Recv(0, "k")]),
    ]
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(2, 1e9, latency=0))
    rt = Runtime(env, net, Textbook(env, net))
    for gpu, name, t in tasks:
        rt.start(gpu, name, t)
    env.run()
    plain = [(r[3], r[6], r[7]) for r in rt.rows if r[2] == "compute" and r[0] == 0]
    assert runtime(0.25, tasks) == plain
    assert plain[-1][2] == pytest.approx(1.3 * MS, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    start=st.floats(0, 10),
    work=st.floats(1e-3, 10),
    s=st.floats(0.01, 1),
    first_slow=st.booleans(),
    gaps=st.lists(st.floats(1e-3, 3), max_size=6),
)
def test_the_time_a_span_loses_is_the_slowdown_of_the_time_it_ran_slow(
    start, work, s, first_slow, gaps
):
    """Whatever its rate changes, a span of `work` seconds ends after work + s / (1 + s) x
    (the real time it ran slow): at rate 1 / (1 + s), a second of slow running does
    1 / (1 + s) of work. The slow time is measured here from the change instants alone."""
    span = Span(start, start + work, first_slow, 1 + s)
    now, slow, slow_time = start, first_slow, 0.0
    for g in gaps:
        if now + g >= span.end():
            break
        slow_time += g if slow else 0.0
        now += g
        slow = not slow
        span.change(now, slow)
    end = span.end()
    slow_time += (end - now) if slow else 0.0
    assert end - start == pytest.approx(work + s / (1 + s) * slow_time, rel=1e-9, abs=1e-12)
    # the warp maps the span's own end (unstretched) to its real end, the start to itself
    assert span.warp(np.array([start, start + work])).tolist() == pytest.approx(
        [start, end], rel=1e-9, abs=1e-12
    )


def run_fsdp(**overlap):
    """ZeRO-3 over 4 GPUs on a 10 GB/s ring: 4 units of 4 MB, each gather 0.3 ms."""
    cfg = {
        "num_gpus": 4,
        "batch_size": 32,
        "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": 0},
        "parallelism": {"mode": "fsdp", "stage": 3},
        "communication": {"kind": "textbook"},
        "overlap": overlap,
    }
    return Simulation(cfg, trace=chain_trace(batch=8, layers=4)).run()


def overlap_with_comm(result, gpu):
    """Seconds GPU `gpu` computes while one of its collectives is in flight (from the
    stream's arrival: its wait row, then its comm row)."""
    tl = result.timeline
    tl = tl[tl.gpu == gpu]
    comp = tl[tl.kind == "compute"][["start", "end"]].to_numpy()
    comm = tl[(tl.kind == "comm") | tl.name.str.startswith("wait ")][["start", "end"]]
    windows = sorted(map(tuple, comm.to_numpy()))
    merged = []
    for a, b in windows:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in comp for c, d in merged)


def test_fsdp_compute_grows_by_the_slowdown_of_its_overlap():
    """ZeRO-3 on 4 GPUs (test_sharded's layout): each GPU's compute time grows by exactly
    s / (1 + s) x the time it computed beside a collective, the iteration by no more than
    that, and with s = 0 the run is the one without the section."""
    free, slow = run_fsdp(compute_slowdown=0.0), run_fsdp(compute_slowdown=0.2)
    assert free.iteration_time == run_fsdp().iteration_time
    for gpu in range(4):
        grown = _compute(slow, gpu) - _compute(free, gpu)
        overlap = overlap_with_comm(slow, gpu)
        assert overlap > 1 * MS  # (the gathers do overlap: 3 of 4 per pass)
        assert grown == pytest.approx(0.2 / 1.2 * overlap, rel=1e-9)
    assert free.iteration_time < slow.iteration_time
    assert slow.iteration_time - free.iteration_time <= 0.2 / 1.2 * overlap + 1e-12


def _compute(result, gpu):
    tl = result.timeline
    c = tl[(tl.gpu == gpu) & (tl.kind == "compute")]
    return float((c.end - c.start).sum())


def test_auto_is_the_published_slowdown_for_gpu_traces_only():
    cfg = {"num_gpus": 2, "batch_size": 16, "parallelism": {"mode": "ddp"}}
    t = chain_trace(batch=8, layers=4)
    assert Simulation(cfg, trace=t).run().overlap == "free (not a GPU trace)"
    t.metadata["device"] = "cuda:0"
    r = Simulation(cfg, trace=t).run()
    assert r.overlap.startswith(f"compute {PUBLISHED_SLOWDOWN * 100:g} % slower")
    assert "overlap" in r.summary()


@pytest.mark.parametrize("bad", [-0.1, 1.5, "fast"])
def test_a_bad_slowdown_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match="overlap.compute_slowdown"):
        Simulation({"overlap": {"compute_slowdown": bad}}, trace=chain_trace())


def test_a_symmetric_run_equals_the_exact_one_with_contention():
    """FSDP over 8 GPUs, 25 % slower beside communication: one representative's run gives
    the exact run's iteration and compute (the copies communicate alike, so they slow
    alike), and that compute is more than without the slowdown."""
    results = {}
    for symmetry, slowdown in (("off", 0.25), ("auto", 0.25), ("off", 0.0)):
        cfg = {
            "num_gpus": 8,
            "batch_size": 64,
            "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": 0},
            "parallelism": {"mode": "fsdp", "stage": 3},
            "overlap": {"compute_slowdown": slowdown},
            "symmetry": symmetry,
        }
        run = Simulation(cfg, trace=chain_trace(batch=8, layers=4)).run()
        results[symmetry, slowdown] = run
    exact, sym, free = results["off", 0.25], results["auto", 0.25], results["off", 0.0]
    assert sym.symmetry.startswith("auto: 1 representative")
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    assert _compute(sym, 0) == pytest.approx(_compute(exact, 0), rel=1e-12)
    assert _compute(exact, 0) > _compute(free, 0) + 0.1 * MS
