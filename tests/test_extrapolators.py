import itertools

import networkx as nx
import pytest
import simpy

from extrapolators.communication.base import Textbook
from extrapolators.execution import Runtime
from extrapolators.execution.tasks import Recv, Send, Signal, Wait
from networks import PacketSwitchNetwork
from networks import topology as topo
from tests.conftest import chain_trace
from triosim.common.errors import ConfigError, DeadlockError, SimulationError
from triosim.simulation.wiring import Simulation

GB = 1e9
FAST = {"kind": "ring", "bandwidth": 1e30, "latency": 0.0}
# the closed forms below are the textbook alpha-beta algorithms' (NCCL's model is tested in
# test_nccl.py)
TEXTBOOK = {"kind": "textbook"}


def sim(trace, n, mode, topology=None, batch_size=None, comm=TEXTBOOK, **par):
    cfg = {
        "num_gpus": n,
        "batch_size": batch_size,
        "parallelism": {"mode": mode, **par},
        "topology": topology or {"kind": "ring", "bandwidth": 10 * GB, "latency": 1e-6},
        "communication": comm,
    }
    s = Simulation(cfg, trace=trace)
    r = s.run()
    r.extrapolator = s.extrapolator  # the plan it ran (buckets, stages, roles) for the checks
    return r


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_dp_adds_exactly_the_ring_allreduce_time(n):
    t = chain_trace(batch=8 * n)
    r = sim(t, n, "dp", {"kind": "ring", "bandwidth": 10 * GB, "latency": 2e-6})
    compute = r.per_gpu()["compute"].max()
    grads = t.weight_bytes()
    ring = 2 * (n - 1) / n * grads / (10 * GB) + 2 * (n - 1) * 2e-6
    assert r.iteration_time == pytest.approx(compute + ring, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_allreduce_moves_2n_minus_1_over_n_per_gpu(n):
    t = chain_trace(batch=16)
    r = sim(t, n, "dp")
    assert r.bytes_delivered == pytest.approx(n * 2 * (n - 1) / n * t.weight_bytes())


@pytest.mark.parametrize("bw", [1 * GB, 10 * GB, 100 * GB])
def test_ddp_never_slower_than_dp(bw):
    t = chain_trace(batch=32, layers=6)
    top = {"kind": "ring", "bandwidth": bw, "latency": 1e-6}
    dp = sim(t, 4, "dp", top)
    ddp = sim(t, 4, "ddp", top, bucket_size=4e6)
    assert ddp.iteration_time <= dp.iteration_time * (1 + 1e-12)


def test_ddp_with_infinitely_fast_network_equals_compute():
    t = chain_trace(batch=32, layers=6)
    r = sim(t, 4, "ddp", FAST, bucket_size=5e6)
    assert r.iteration_time == pytest.approx(r.per_gpu()["compute"].max(), rel=1e-12)


def test_ddp_reduces_every_gradient_including_leftover_bucket():
    t = chain_trace(batch=32, layers=5, weight_bytes=3e6)
    r = sim(t, 2, "ddp", bucket_size=7e6, first_bucket_size=7e6)  # 3+3+3 | 3+3 (leftover)
    assert r.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes())
    # (the bucket's bytes over a layer's 3 MB: its gradients)
    assert [b[1] / 3e6 for b in r.extrapolator.buckets[0]] == [3, 2]
    # PyTorch's small first bucket: the last layer's gradient goes alone, early
    r = sim(t, 2, "ddp", bucket_size=7e6, first_bucket_size=2**20)  # 3 | 3+3+3 | 3
    assert [b[1] / 3e6 for b in r.extrapolator.buckets[0]] == [1, 3, 1]
    assert r.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes())


def test_tp_degree_one_and_gpipe_one_gpu_equal_single():
    t = chain_trace()
    single = sim(t, 1, "single").iteration_time
    assert single == pytest.approx(t.total_time)
    assert sim(t, 1, "tp").iteration_time == pytest.approx(single)
    assert sim(t, 1, "gpipe").iteration_time == pytest.approx(single)


@pytest.mark.parametrize("S,M", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_gpipe_forward_span(S, M):
    # S equal stages of forward time t: the last forward ends at (M + S - 1) t / M
    t_layer = 1e-3
    tr = chain_trace(layers=S, batch=8 * M, t_fwd=t_layer, t_bwd=2e-3, t_opt=0)
    r = sim(tr, S, "gpipe", FAST, microbatches=M)
    fwd = r.timeline[(r.timeline.phase == "forward") & (r.timeline.kind == "compute")]
    assert fwd.end.max() == pytest.approx((M + S - 1) * t_layer / M, rel=1e-6)
    # and every stage got exactly one layer (balanced by time)
    assert [len(x) for x in r.extrapolator.pipe.fwd_ops] == [1] * S


def test_1f1b_matches_gpipe_time_with_equal_stages():
    tr = chain_trace(layers=4, batch=32, t_opt=0)
    g = sim(tr, 4, "gpipe", FAST, microbatches=4).iteration_time
    o = sim(tr, 4, "1f1b", FAST, microbatches=4).iteration_time
    assert o == pytest.approx(g, rel=1e-9)


@pytest.mark.parametrize(
    "mode,fwd_ms,bwd_ms,in_flight",
    [
        # stage 0 / stage 1 start times (ms) of forwards and backwards, by micro-batch
        ("1f1b", ([0, 1, 6, 9], [1, 4, 7, 10]), ([4, 7, 10, 13], [2, 5, 8, 11]), 2),
        ("gpipe", ([0, 1, 2, 3], [1, 2, 3, 4]), ([13, 11, 9, 7], [11, 9, 7, 5]), 4),
    ],
)
def test_pipeline_schedules_hand_timeline(mode, fwd_ms, bwd_ms, in_flight):
    # 2 stages of one layer each (forward 1 ms, backward 2 ms per micro-batch), M = 4, free
    # network. 1F1B: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, stage 1 F0 B0 F1 B1 ... so B0 of
    # stage 0 starts at 4 (stage 1: F0 [1,2], B0 [2,4]) and each later F/B pair waits 3 ms
    # for its partner. GPipe: all forwards, then backwards from micro-batch 3: stage 1 B3
    # at 5, stage 0 B3 at 7, then every 2 ms. Both end at 15 ms with 12 ms of compute per
    # GPU: 3 ms idle. 1F1B keeps at most 2 micro-batches' activations on stage 0, GPipe 4.
    tr = chain_trace(layers=2, batch=2, t_fwd=1e-3, t_bwd=2e-3, t_opt=0)
    r = sim(tr, 2, mode, FAST, batch_size=8, microbatches=4)
    c = r.timeline[r.timeline.kind == "compute"]
    for s in (0, 1):
        order = [(k, m) for k, m, _ in r.extrapolator.orders[s]]
        mine = c[c.gpu == s]
        assert [p[0].upper() for p in mine.phase] == [k for k, _ in order]
        start = dict(zip(order, mine.start * 1e3, strict=True))
        assert [start["F", m] for m in range(4)] == pytest.approx(fwd_ms[s])
        assert [start["B", m] for m in range(4)] == pytest.approx(bwd_ms[s])
    held = itertools.accumulate(1 if k == "F" else -1 for k, _, _ in r.extrapolator.orders[0])
    assert max(held) == in_flight
    assert r.iteration_time == pytest.approx(15e-3)
    assert r.per_gpu()["idle"].tolist() == pytest.approx([3e-3, 3e-3])


def test_tp_pairs_column_and_row_layers_megatron_style():
    t = chain_trace(batch=8)  # four linear layers in a chain: pairs (0, 1) and (2, 3)
    r = sim(t, 4, "tp")
    roles = r.extrapolator.tpx.roles
    assert [roles[i] for i in range(4)] == ["column", "row", "column", "row"]
    comm = r.timeline[(r.timeline.kind == "comm") & (r.timeline.gpu == 0)]
    # one all-reduce per pair in forward (after the row layer), one in backward (after the
    # column layer's backward), each of one activation; but the first column layer reads
    # the model's input, which has no gradient: nothing to reduce for it
    assert list(comm.phase) == ["forward", "forward", "backward"]
    assert (comm.name == "allreduce").all() and (comm.nbytes == t.tensors[0].nbytes).all()
    assert r.iteration_time > sim(t, 4, "tp", FAST).iteration_time


def test_tp_unpaired_layer_gathers_its_output():
    t = chain_trace(batch=8, layers=3)  # the third layer has no partner
    r = sim(t, 2, "tp")
    roles = r.extrapolator.tpx.roles
    assert roles[2] == "gather" and roles[0] == "column"
    comm = r.timeline[(r.timeline.kind == "comm") & (r.timeline.gpu == 0)]
    # pair: 1 forward all-reduce (its input has no gradient); the lone layer is
    # column-parallel with a gathered output: all-gather forward, all-reduce of its input
    # gradient backward
    assert list(zip(comm.phase, comm.name, strict=True)) == [
        ("forward", "allreduce"),
        ("forward", "all_gather"),
        ("backward", "allreduce"),
    ]


def test_deadlock_names_stuck_gpu_and_task():
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(2, GB))
    rt = Runtime(env, net, Textbook(env, net))
    rt.start(0, "compute", [Recv(1, "never-sent")])
    rt.start(1, "compute", [Send(0, 10.0, "other-key")])
    env.run()
    with pytest.raises(DeadlockError) as e:
        rt.check_finished()
    assert "GPU 0 compute" in str(e.value) and "never-sent" in str(e.value)


def _c(key, group=(0, 1), op="allreduce", algorithm="ring"):
    from extrapolators.execution.tasks import Collective

    return Collective(op, group, 1e6, key, algorithm=algorithm)


@pytest.mark.parametrize(
    "streams,error,match",
    [
        ({(0, "a"): [Signal("k"), Signal("k")]}, SimulationError, "signal 'k' fired twice"),
        ({(0, "a"): ["not a task"]}, SimulationError, "unknown task 'not a task'"),
        ({(0, "a"): [_c("c", group=(1,))]}, SimulationError, "of group .* it is not in"),
        (
            {(0, "a"): [_c("c")], (1, "a"): [_c("c", group=(1, 0))]},
            SimulationError,
            "different groups",
        ),
        ({(0, "a"): [_c("c")], (0, "b"): [_c("c")]}, SimulationError, "GPU 0 posted .* twice"),
        (
            {(0, "a"): [_c("c", algorithm="tree")], (1, "a"): [_c("c", algorithm="tree")]},
            ConfigError,
            "communication.algorithm.*one of ring",
        ),
        (
            {(0, "a"): [_c("c", op="gossip")], (1, "a"): [_c("c", op="gossip")]},
            ConfigError,
            "'collective' = 'gossip'",
        ),
        (
            {(0, "a"): [Wait("x")], (1, "a"): [_c("c")], (1, "b"): [Send(0, 1.0, "s")]},
            DeadlockError,
            r"signal 'x' \(never fired\)[\s\S]*allreduce 'c' over GPUs \[0, 1\] \(missing GPUs \[0\]\)",
        ),
    ],
)
def test_runtime_names_what_is_wrong_with_the_streams(streams, error, match):
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(2, GB))
    rt = Runtime(env, net, Textbook(env, net))
    with pytest.raises(error, match=match):
        for (gpu, name), tasks in streams.items():
            rt.start(gpu, name, tasks)
        env.run()
        rt.check_finished()


def test_plan_errors_name_the_field():
    t = chain_trace(batch=4)
    with pytest.raises(ConfigError, match="microbatches"):
        sim(t, 2, "gpipe", microbatches=8)
    with pytest.raises(ConfigError, match="num_gpus"):
        sim(t, 3, "single")
    with pytest.raises(ConfigError, match="num_gpus"):
        sim(chain_trace(layers=2), 4, "gpipe")
    with pytest.raises(ConfigError, match="batch_size"):
        sim(t, 8, "dp")


def test_more_bandwidth_never_slows_dp_or_ddp():
    t = chain_trace(batch=32, layers=6)
    for mode in ("dp", "ddp", "tp", "gpipe"):
        times = [
            sim(
                t,
                4,
                mode,
                {"kind": "ring", "bandwidth": bw, "latency": 1e-6},
                **({"microbatches": 2} if mode == "gpipe" else {}),
            ).iteration_time
            for bw in (1 * GB, 4 * GB, 16 * GB)
        ]
        assert times == sorted(times, reverse=True)


def test_ring_order_follows_mesh():
    from extrapolators.communication.collectives import ring_order

    g = topo.mesh2d(3, 4, GB)
    order = ring_order(g, list(range(12)))
    hops = [nx.shortest_path_length(g, a, b) for a, b in zip(order, order[1:], strict=False)]
    assert hops == [1] * 11  # a Hamiltonian path of the 3 x 4 mesh: every step one hop


@pytest.mark.parametrize("mode,n", [("ddp", 64), ("tp", 16), ("1f1b", 16)])
def test_streams_are_lazy_so_memory_does_not_grow_with_gpus_x_trace(mode, n):
    # n GPUs x 1001 operators: task lists made up front would be ~n x 1001 x 100 B (1.6 to
    # 6 MB). Streams are generators that have produced nothing yet: building them all
    # allocates what the per-trace plan needs (tens of kB), not a copy per GPU.
    import inspect
    import tracemalloc

    from extrapolators.modes import extrapolator_class
    from extrapolators.modes.pipeline import PipelineOptions
    from perfmodel import make_model

    t = chain_trace(layers=500, batch=64)
    opts = PipelineOptions(microbatches=4) if mode == "1f1b" else None
    ex = extrapolator_class(mode)(
        t, make_model("regression", t), range(n), opts, batch_size=64, ring=range(n)
    )
    tracemalloc.start()
    try:
        streams = ex.streams()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert {g for g, _ in streams} == set(range(n))
    assert all(inspect.getgeneratorstate(s) == inspect.GEN_CREATED for s in streams.values())
    assert peak < 500e3


@pytest.mark.parametrize(
    "op,steps,chunks",
    [
        ("allreduce", lambda n: 2 * (n - 1), lambda n: n),
        ("reduce_scatter", lambda n: n - 1, lambda n: n),
        ("all_gather", lambda n: n - 1, lambda n: n),
        ("broadcast", lambda n: 2 * n - 2, lambda n: n),
        ("reduce", lambda n: 2 * n - 2, lambda n: n),
    ],
)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_collectives_closed_forms(op, steps, chunks, n):
    # on a one-way ring every step moves one chunk per link: steps x (S/chunks/B + L)
    from extrapolators.execution.tasks import Collective

    size, bw, lat = 6e8, 10 * GB, 3e-6
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.ring(n, bw, lat, bidirectional=False))
    rt = Runtime(env, net, Textbook(env, net))
    for g in range(n):
        algo = "direct" if op == "all_to_all" else "ring"
        rt.start(g, "comm", [Collective(op, tuple(range(n)), size, "c", algorithm=algo, root=0)])
    env.run()
    rt.check_finished()
    want = steps(n) * (size / chunks(n) / bw + lat)
    assert env.now == pytest.approx(want, rel=1e-9)


def test_all_to_all_on_fully_connected():
    from extrapolators.execution.tasks import Collective

    n, size, bw = 4, 8e8, 10 * GB
    env = simpy.Environment()
    net = PacketSwitchNetwork(env, topo.fully_connected(n, bw, 1e-6))
    rt = Runtime(env, net, Textbook(env, net))
    for g in range(n):
        rt.start(
            g, "comm", [Collective("all_to_all", tuple(range(n)), size, "a", algorithm="direct")]
        )
    env.run()
    assert env.now == pytest.approx(size / n / bw + 1e-6)
    assert net.bytes_delivered == pytest.approx(n * (n - 1) * size / n)


def test_a_user_network_plugs_in_by_subclassing(scratch_registries):
    # the paper's "Send and Deliver" point: a new network is one subclass, nothing else changes
    from dataclasses import dataclass

    from networks import Network, register
    from triosim.common.schema import option

    @dataclass(frozen=True)
    class DelayOptions:  # its config fields, with units, checked like every built-in part's
        delay: float = option(1e-3, unit="seconds", ge=0, help="every transfer's time")

    @register("constant-delay")
    class ConstantDelay(Network):
        Options = DelayOptions

        def _start_group(self, records, events):
            for rec, ev in zip(records, events, strict=True):
                self.env.timeout(self.options.delay).callbacks.append(
                    lambda _e, r=rec, v=ev: self._deliver(r, v)
                )

    t = chain_trace(batch=16)
    n = 4
    r = Simulation(
        {
            "num_gpus": n,
            "parallelism": {"mode": "dp"},
            "communication": TEXTBOOK,
            "network": {"kind": "constant-delay", "delay": "2 ms"},
        },
        trace=t,
    ).run()
    compute = r.per_gpu()["compute"].max()
    assert r.iteration_time == pytest.approx(compute + 2 * (n - 1) * 2e-3)
    with pytest.raises(ConfigError, match="network.delay.*a time in seconds"):
        Simulation({"num_gpus": n, "network": {"kind": "constant-delay", "delay": "2 GB"}}, trace=t)


def test_a_user_parallelism_mode_plugs_in(scratch_registries):
    from extrapolators.modes import DataParallel, register

    @register
    class HalfGradients(DataParallel):  # e.g. gradient compression: half the bytes reduced
        name = "dp-half"

        def grad_bytes(self, p, kind="dense"):
            return super().grad_bytes(p, kind) / 2

    t = chain_trace(batch=16)
    r = Simulation({"num_gpus": 2, "parallelism": {"mode": "dp-half"}}, trace=t).run()
    assert r.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes() / 2)


def test_gpipe_user_stages_by_layer_name_and_position():
    t = chain_trace(layers=6, batch=8)
    r = sim(t, 3, "gpipe", microbatches=2, stages=["layer1", "layer5"])
    assert [[op.layer for op in s] for s in r.extrapolator.pipe.fwd_ops] == [
        ["layer0"],
        ["layer1", "layer2", "layer3", "layer4"],
        ["layer5"],
    ]
    r = sim(t, 2, "gpipe", microbatches=2, stages=[4])
    assert [len(s) for s in r.extrapolator.pipe.fwd_ops] == [4, 2]
    assert [len(s) for s in r.extrapolator.pipe.bwd_ops] == [4, 2]
    with pytest.raises(ConfigError, match="parallelism.stages"):
        sim(t, 3, "gpipe", stages=["nolayer", "layer2"])
    with pytest.raises(ConfigError, match="parallelism.stages"):
        sim(t, 3, "gpipe", stages=[3])


def test_hybrid_dp_of_single_gpus_is_plain_dp():
    t = chain_trace(batch=16)
    top = {"kind": "ring", "bandwidth": 10 * GB, "latency": 1e-6}
    assert sim(t, 4, "hybrid", top, dp=4, inner="single").iteration_time == pytest.approx(
        sim(t, 4, "dp", top).iteration_time, rel=1e-12
    )


def test_hybrid_with_one_replica_is_the_inner_mode():
    t = chain_trace(batch=16, layers=4)
    assert sim(t, 2, "hybrid", dp=1, inner="gpipe", microbatches=2).iteration_time == pytest.approx(
        sim(t, 2, "gpipe", microbatches=2).iteration_time, rel=1e-12
    )


def test_hybrid_dp_over_pipelines_on_a_free_network_is_one_pipeline_on_its_share():
    t = chain_trace(batch=16, layers=4)
    hybrid = sim(t, 4, "hybrid", FAST, dp=2, inner="gpipe", microbatches=2, batch_size=16)
    one = Simulation(
        {
            "num_gpus": 2,
            "batch_size": 8,
            "topology": FAST,
            "communication": TEXTBOOK,
            "parallelism": {"mode": "gpipe", "microbatches": 2},
        },
        trace=t,
    ).run()
    assert hybrid.iteration_time == pytest.approx(one.iteration_time, rel=1e-9)
    # each stage position all-reduces what it holds: together, every weight once
    assert hybrid.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes())


def test_hybrid_dp_over_tensor_parallel_reduces_the_shards():
    t = chain_trace(batch=16, layers=4)
    r = sim(t, 4, "hybrid", dp=2, inner="tp")
    # per replica, at batch/2: 2 pairs x forward + the second pair's backward (the first
    # pair's input is the model's input, which has no gradient)
    tp_allreduce = 3 * t.tensors[0].nbytes / 2
    shards = 2 * t.weight_bytes() / 2  # 2 positions, each holding half of every weight
    assert r.collective_bytes["allreduce"] == pytest.approx(2 * tp_allreduce + shards)


def test_hybrid_errors():
    t = chain_trace(batch=16)
    with pytest.raises(ConfigError, match="parallelism.dp"):
        sim(t, 4, "hybrid", dp=3, inner="single")
    with pytest.raises(ConfigError, match="parallelism.inner"):
        sim(t, 4, "hybrid", dp=2, inner="hybrid")
    with pytest.raises(ConfigError, match="parallelism.inner"):
        sim(t, 4, "hybrid", dp=2, inner="nope")


@pytest.mark.parametrize("mode", ["dp", "ddp"])
def test_gradient_accumulation_reduces_once_after_the_last_micro_step(mode):
    # 2 GPUs, batch 16, 2 accumulation steps: each GPU runs forward + backward twice on 4
    # samples, then one all-reduce of all gradients (DDP: buckets only in the last step,
    # as under no_sync()), then the optimizer
    t = chain_trace(batch=8)
    top = {"kind": "ring", "bandwidth": 10 * GB, "latency": 0.0}
    acc = sim(t, 2, mode, top, batch_size=16, accumulation_steps=2)
    tl = acc.timeline[acc.timeline.gpu == 0]
    comp = tl[tl.kind == "compute"]
    assert (comp.phase != "optimizer").sum() == 2 * sum(
        op.phase != "optimizer" for op in t.operators
    )
    assert sorted(comp.microbatch.unique()) == [0, 1]
    assert acc.collective_bytes["allreduce"] == pytest.approx(t.weight_bytes())
    comms = tl[tl.kind == "comm"]
    last_step_start = comp[comp.microbatch == 1]["start"].min()
    assert (comms["start"] >= last_step_start).all()
    one = sim(t, 2, mode, top, batch_size=8)  # one step of 4 samples per GPU, for comparison
    fb = comp[comp.phase != "optimizer"]
    fb1 = one.timeline[
        (one.timeline.gpu == 0)
        & (one.timeline.kind == "compute")
        & (one.timeline.phase != "optimizer")
    ]
    assert (fb.end - fb.start).sum() == pytest.approx(2 * (fb1.end - fb1.start).sum(), rel=1e-12)
