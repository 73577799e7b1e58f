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
    # the warp maps the span's start to itself and its own end (unstretched) to its real
    # end, the same double (the runtime resumes at one and logs the other)
    warped = span.warp(np.array([start, start + work])).tolist()
    assert warped[0] == pytest.approx(start, rel=1e-12, abs=1e-15)
    assert warped[1] == end


def test_a_slowed_span_ends_where_its_warp_says_to_the_bit():
    """Slowed from t1 to t2, then at full speed: end_u + (r0 - u0) would round one ulp
    away from the warp's r0 + (end_u - u0) here, and the next row would start before this
    one's logged end (found by fuzzing the runtime)."""
    start, work, factor = 0.0011428193144282783, 0.49357786646532464, 1.8676027754927809
    span = Span(start, start + work, False, factor)
    span.change(0.10949292851390163, True)
    span.change(0.14201336478864063, False)
    assert span.warp(np.array([start + work]))[0] == span.end()


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
    s / (1 + s) x the time it computed beside a collective, and the iteration by no more
    than the most any GPU lost."""
    free, slow = run_fsdp(compute_slowdown=0.0), run_fsdp(compute_slowdown=0.2)
    lost = []
    for gpu in range(4):
        grown = _compute(slow, gpu) - _compute(free, gpu)
        overlap = overlap_with_comm(slow, gpu)
        assert overlap > 1 * MS  # (the gathers do overlap: 3 of 4 per pass)
        assert grown == pytest.approx(0.2 / 1.2 * overlap, rel=1e-9)
        lost.append(grown)
    assert free.iteration_time < slow.iteration_time
    assert slow.iteration_time - free.iteration_time <= max(lost) + 1e-12


def test_a_host_bound_run_is_slowed_in_its_kernels_not_in_its_waits():
    """Ten 0.01 ms kernels, each issued 0.1 ms after the last by the host (the GPU waits
    for every launch), beside a 2 ms send, 50 % slower: each kernel takes 0.015 ms, the
    waits absorb it, and the last, launched at 1.0 ms, ends at 1.015 ms (1.010 without
    contention); stretching the waits too would end it at 1.515."""
    from types import SimpleNamespace

    def last_end(slowdown):
        env = simpy.Environment()
        net = PacketSwitchNetwork(env, topo.ring(2, 1e9, latency=0))
        host = SimpleNamespace(comm_cost=0.0, launch_latency=0.0)
        contention = Contention(env, slowdown) if slowdown else None
        rt = Runtime(env, net, Textbook(env, net), host=host, contention=contention)
        run = ComputeRun(
            [Compute(f"k{i}", "l", "forward", 0.01 * MS, 0, 0, host=0.1 * MS) for i in range(10)]
        )
        rt.start(0, "comm", [Send(1, 2e6, "k")])
        rt.start(0, "compute", [run])
        rt.start(1, "compute", [Recv(0, "k")])
        env.run()
        rt.check_finished()
        rows = [r for r in rt.rows if r[0] == 0 and r[2] == "compute"]
        assert all(b[6] >= a[7] for a, b in zip(rows, rows[1:], strict=False))  # in order
        assert sum(r[7] - r[6] for r in rows) == pytest.approx(
            10 * 0.01 * MS * (1 + slowdown), rel=1e-9
        )
        return rows[-1][7]

    assert last_end(0.0) == pytest.approx(1.010 * MS, rel=1e-12)
    assert last_end(0.5) == pytest.approx(1.015 * MS, rel=1e-12)


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
