"""DeepEP's dispatch (`dispatcher: deepep`, extrapolators/modes/moe_loads.py): a token
crosses the NICs once per node it is routed to and is forwarded over NVLink once per GPU,
under group-limited routing; checked against an enumeration of every routing, by hand on a
2 x 2 system, end to end on a timeline, and against DeepEP's published bandwidths."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.modes import moe_loads
from tests.test_expert_parallel import TB, TIMES, T, moe_trace
from triosim import Simulation
from triosim.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def enumerated_hit(A: set, experts: int, groups: int, top_groups: int, k: int) -> Fraction:
    """P(a token hits A) by listing every routing: each choice of top_groups groups, then
    each choice of k of their experts, all equally likely."""
    X = experts // groups
    hit = total = Fraction(0)
    for S in itertools.combinations(range(groups), top_groups):
        pool = [e for g in S for e in range(g * X, (g + 1) * X)]
        n = math.comb(len(pool), k)
        for chosen in itertools.combinations(pool, k):
            w = Fraction(1, n)
            total += w
            hit += w if A & set(chosen) else 0
    return hit / total


@settings(max_examples=60, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 3, 4]),
    per_group=st.sampled_from([1, 2, 3]),
    data=st.data(),
)
def test_hit_probability_is_the_enumerated_routings(groups, per_group, data):
    experts = groups * per_group
    top = data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, top * per_group))
    A = set(data.draw(st.lists(st.integers(0, experts - 1), unique=True, max_size=experts)))
    counts = [len([e for e in A if e // per_group == g]) for g in range(groups)]
    got = moe_loads.hit_probability(counts, per_group, top, k)
    assert got == pytest.approx(float(enumerated_hit(A, experts, groups, top, k)), abs=1e-12)


def test_two_nodes_of_two_gpus_by_hand():
    """8 experts, 2 a GPU, 4 GPUs on 2 nodes, top-2, no groups; T tokens of b bytes a GPU.
    A token hits a GPU (2 of 8 experts) with 1 - C(6,2)/C(8,2) = 13/28, a node (4 of 8)
    with 1 - C(4,2)/C(8,2) = 22/28. GPU 0 sends GPU 2 (the other node's GPU at its
    position, its gateway) T x 22/28 x b and GPU 3 nothing; GPU 0 is GPU 2's gateway in
    turn, so to GPU 1 it sends its own tokens and forwards GPU 2's: 2 x T x 13/28 x b (its
    own for itself, T x 13/28 x b, stay: the diagonal)."""
    ep, E, k, b = 4, 8, 2, 100.0
    copies = moe_loads.dispatch_sizes(moe_loads.kept_tokens([1 / E] * E, T, k, ep, None), ep, b)
    assert copies[0][1] == pytest.approx(T * k / ep * b)  # the all-to-all: a copy per expert
    got = moe_loads.deepep_sizes(copies, [0, 0, 1, 1], E, k)
    gpu, node = T * 13 / 28 * b, T * 22 / 28 * b
    want = [
        [gpu, 2 * gpu, node, 0],
        [2 * gpu, gpu, 0, node],
        [node, 0, gpu, 2 * gpu],
        [0, node, 2 * gpu, gpu],
    ]
    assert [list(r) for r in got] == [pytest.approx(r) for r in want]


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.sampled_from([1, 2, 4]),
    per_node=st.sampled_from([1, 2, 4]),
    per_gpu=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_nic_bytes_never_exceed_the_all_to_alls(nodes, per_node, per_gpu, data):
    """Over the NICs DeepEP sends each token once per node, the all-to-all once per expert
    there: never more, and the same where a node holds one expert. Every GPU receives each
    token routed to it once: the tokens reaching it (directly or forwarded) are T x its hit
    probability from each source."""
    ep = nodes * per_node
    E = ep * per_gpu
    groups = data.draw(st.sampled_from([g for g in (1, 2, nodes, E) if E % g == 0]))
    top = data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, min(4, top * E // groups)))
    node_of = [j // per_node for j in range(ep)]
    copies = moe_loads.dispatch_sizes(moe_loads.kept_tokens([1 / E] * E, T, k, ep, None), ep, 1.0)
    got = moe_loads.deepep_sizes(copies, node_of, E, k, groups, top)
    for i in range(ep):
        cross = [j for j in range(ep) if node_of[j] != node_of[i]]
        nic = sum(got[i][j] for j in cross)
        a2a = sum(copies[i][j] for j in cross)
        assert nic <= a2a * (1 + 1e-12)
        if E == nodes:  # one expert a node: the same copies
            assert nic == pytest.approx(a2a)
    X = E // groups
    p_node = moe_loads.hit_probability(
        [len([e for e in range(per_node * per_gpu) if e // X == g]) for g in range(groups)],
        X,
        top,
        k,
    )  # node 0's experts (every node alike where groups align; checked on node 0's GPUs)
    for j in range(ep):
        counts = [0] * groups
        for e in range(j * per_gpu, (j + 1) * per_gpu):
            counts[e // X] += 1
        p = moe_loads.hit_probability(counts, X, top, k)
        # every source's tokens for j reach it once: from its own node (its sources, and
        # the gateways forwarding the other nodes'), or kept where j is the gateway
        own = sum(got[i][j] for i in range(ep) if node_of[i] == node_of[j])
        assert own + (nodes - 1) * T * p == pytest.approx(ep * T * p)
        if node_of[j] == 0:  # over the NICs into gateway j: one copy a token from each
            nic_in = sum(got[i][j] for i in range(ep) if node_of[i] != node_of[j])
            assert nic_in == pytest.approx((nodes - 1) * T * p_node)


def ep_run(dispatcher, comm="textbook", **extra):
    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "ep", "ep": 4, "dispatcher": dispatcher, **extra},
        # NVLink 1000 x the NIC: the forwarding's time is the NIC's / 1000
        "topology": {
            "kind": "multi_node",
            "gpus_per_node": 2,
            "bandwidth": 1e13,
            "latency": 0.0,
            "inter_bandwidth": 1e10,
            "inter_latency": 0.0,
        },
        "communication": {"kind": comm},
        "perfmodel": {"kind": "trace"},
    }
    sim = Simulation(cfg, trace=moe_trace(experts=4, top_k=2))
    return sim, sim.run()


def test_dispatch_on_the_timeline_by_hand():
    """4 experts on 4 GPUs (2 nodes of 2), top-2. The all-to-all sends each GPU's T tokens
    x 2 / 4 to each other GPU: T x b over its NIC (2 peers off its node), T x b / 1e10 s.
    DeepEP sends one copy per token to the other node where a token hits it (2 of its 4
    experts: 1 - C(2,2)/C(4,2) = 5/6), over the NIC to one gateway: 5/6 of the time, plus
    the forwarding over NVLink (1/1000 of the NIC's time per byte) running beside it."""
    nic = T * TB / 1e10
    for dispatcher, want in (("alltoall", nic), ("deepep", 5 / 6 * nic)):
        _, r = ep_run(dispatcher)
        tl = r.timeline
        rows = tl[(tl["name"] == "all_to_all") & (tl["gpu"] == 0)]
        assert len(rows) == 4
        assert (rows["end"] - rows["start"]).to_numpy() == pytest.approx([want] * 4, rel=2e-3)
    # the rest of the iteration is the same: the difference is the four all-to-alls'
    _, a = ep_run("alltoall")
    _, d = ep_run("deepep")
    assert a.iteration_time - d.iteration_time == pytest.approx(4 * nic / 6, rel=2e-3)
    assert a.iteration_time > sum(TIMES.values())
    # with NCCL's model too: DeepEP's streams are not held to NCCL's per-pair rate (there
    # the gateway pairs, carrying a node's copies, would take longer than the all-to-all)
    a2a = {}
    for dispatcher in ("alltoall", "deepep"):
        _, r = ep_run(dispatcher, comm="nccl")
        tl = r.timeline
        rows = tl[(tl["name"] == "all_to_all") & (tl["gpu"] == 0)]
        a2a[dispatcher] = (rows["end"] - rows["start"]).sum()
    assert a2a["deepep"] < 0.9 * a2a["alltoall"]


def test_fp8_dispatch_sends_a_byte_and_a_scale_per_128_values():
    """hidden 1024 in float8: 1024 bytes + 8 float32 scales = 1056 a token, the forward
    dispatch only; the combine and the gradients in bfloat16 (2048)."""
    sim, _ = ep_run("alltoall", dispatch_dtype="float8")
    ex = sim.extrapolator.experts
    assert ex.a2a_sizes("dispatch")[0][1] == pytest.approx(T * 2 / 4 * 1056)
    for kind in ("combine", "combine-grad", "dispatch-grad"):
        assert ex.a2a_sizes(kind)[0][1] == pytest.approx(T * 2 / 4 * 2048)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"router_groups": 2}, "parallelism.router_groups"),  # alltoall: unused, refused
        ({"dispatcher": "deepep", "router_groups": 3}, "parallelism.router_groups"),
        ({"dispatcher": "deepep", "router_groups": 4, "router_group_topk": 1},
         "parallelism.router_group_topk"),  # 1 group of 1 expert, top-2
        ({"dispatcher": "deepep", "router_groups": 2, "router_group_topk": 3},
         "parallelism.router_group_topk"),
    ],
)  # fmt: skip
def test_bad_routing_fields_name_their_field(extra, field):
    par = {"dispatcher": "alltoall", **extra}
    with pytest.raises(ConfigError) as e:
        ep_run(par.pop("dispatcher"), **par)
    assert e.value.field == field


def test_an_ep_group_spread_unevenly_over_nodes_is_refused():
    """8 GPUs on 2 nodes of 4, EP groups of 4 placed by `order` as GPUs 0, 1, 2, 4 and 3,
    5, 6, 7: 3 and 1 on a node, and DeepEP's gateway (the GPU at the sender's position in
    the other node) is missing. Refused, naming the field."""
    cfg = {
        "num_gpus": 8,
        "batch_size": 16,
        "parallelism": {
            "mode": "mesh",
            "dp_replicate": 8,
            "ep": 4,
            "dispatcher": "deepep",
            "order": [0, 1, 2, 4, 3, 5, 6, 7],
        },
        "topology": {"kind": "multi_node", "gpus_per_node": 4, "bandwidth": 1e12},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "trace"},
    }
    with pytest.raises(ConfigError, match="unevenly") as e:
        Simulation(cfg, trace=moe_trace(experts=4, top_k=2))
    assert e.value.field == "parallelism.dispatcher"
    cfg["parallelism"]["order"] = [0, 4, 1, 5, 2, 3, 6, 7]  # even, but not alike
    with pytest.raises(ConfigError, match="alike") as e:
        Simulation(cfg, trace=moe_trace(experts=4, top_k=2))
    cfg["parallelism"]["order"] = [0, 1, 4, 5, 2, 3, 6, 7]  # two a node, alike: runs
    Simulation(cfg, trace=moe_trace(experts=4, top_k=2)).run()


def nccl_system(n: int, topology: dict):
    """(the NCCL model, the GPUs) of an n-GPU system, as `triosim collectives` builds it."""
    from triosim.config.loading import from_dict
    from triosim.studies.calibration import system

    trace = ROOT / "traces/modelled/h100-sxm/deepseek-v3-s4096-b1.trace.json.gz"
    cfg = from_dict(
        {
            "num_gpus": n,
            "communication": {"kind": "nccl"},
            "topology": topology,
            "trace": str(trace),
        }
    )
    _, _, comm, group = system(cfg)
    return comm, group


def test_nccl_runs_deepep_streams_uncapped():
    """NCCL's uneven all-to-all caps each pair at the even all-to-all's per-pair rate (its
    p2p channels); DeepEP's kernels are not NCCL's: no cap, the network shares the links."""
    comm, group = nccl_system(16, {"kind": "multi_node", "gpus_per_node": 8})
    sizes = tuple(tuple(1e6 * (i != j) for j in range(16)) for i in range(16))
    capped = comm.plan_uneven(tuple(group), sizes)
    free = comm.plan_uneven(tuple(group), sizes, "deepep")
    assert all(math.isfinite(s[3]) for s in capped.streams)
    assert all(math.isinf(s[3]) for s in free.streams)
    assert [s[:3] for s in free.streams] == [s[:3] for s in capped.streams]
    with pytest.raises(ConfigError):
        comm.plan_uneven(tuple(group), sizes, "ring")


def test_simulated_kernels_near_deepeps_published_bandwidth():
    """DeepEP's own measurement at EP 64 (H800, 8 nodes; benchmarks/deepep_dispatch.py has
    the source): FP8 dispatch 51 GB/s, BF16 combine 50 GB/s of its logical RDMA bytes. The
    simulation runs every link at its rated bandwidth, so it may be faster than the real
    kernels, but not by more than a quarter, and never slower."""
    from benchmarks.deepep_dispatch import simulate

    for name, sim, published in simulate(64):
        assert 0.75 * published < sim <= published, name


def test_skewed_loads_never_send_a_token_twice_to_a_gpu_or_node():
    """8 experts, 4 GPUs on 2 nodes, top-2, every token routed to experts 0 and 1 (GPU 0):
    the all-to-all sends GPU 0 two copies a token; DeepEP one. The uniform ratios applied
    to those copies (P(hit GPU 0) 13/28 over the 1/2 copy a token expected there) would
    give 1.86 T; each entry is capped at the sender's T."""
    E, k, ep = 8, 2, 4
    kept = moe_loads.kept_tokens([0.5, 0.5] + [0.0] * 6, T, k, ep, None)
    copies = moe_loads.dispatch_sizes(kept, ep, 1.0)
    assert copies[1][0] == pytest.approx(2 * T)
    got = moe_loads.deepep_sizes(copies, [0, 0, 1, 1], E, k)
    assert got[1][0] == pytest.approx(2 * T)  # its own T, and GPU 3's forwarded by GPU 1
    assert got[2][0] == pytest.approx(T)  # GPU 2 -> its gateway GPU 0: one a token
    assert got[3][1] == pytest.approx(T)  # GPU 3 -> its gateway GPU 1 (who forwards it)
    assert max(max(r) for r in got) <= 2 * T + 1e-6


def test_fp8_dispatch_keeps_the_expert_tp_reduce_scatters_in_bfloat16():
    """With etp 2 the GPUs of an expert-TP group all-gather what the dispatch brought (in
    FP8 with `dispatch_dtype: float8`) and reduce-scatter the experts' outputs (bfloat16),
    and in backward gather and scatter gradients (bfloat16)."""
    from tests.test_ep_tp import trace

    cfg = {
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "mesh", "dp_replicate": 4, "ep": 2, "etp": 2,
                        "dispatch_dtype": "float8"},
        "topology": {"kind": "fully_connected", "bandwidth": 1e10},
        "perfmodel": {"kind": "roofline"},
    }  # fmt: skip
    sim = Simulation(cfg, trace=trace(experts=2, ffn=512))
    ex = sim.extrapolator.experts
    hidden = sim.trace.metadata["moe"]["hidden"]
    ratio = (hidden + 4 * math.ceil(hidden / 128)) / (2 * hidden)
    assert ex.etp_dispatch[0] == pytest.approx(ex.etp_bytes[0] * ratio)
    tl = sim.run().timeline
    etp = tl[tl["key"].astype(str).str.startswith("etp:") & (tl["gpu"] == 0)]
    sent = {k.rsplit(":", 1)[-1]: n for k, n in zip(etp["key"], etp["nbytes"], strict=True)}
    assert sent["dispatch-all_gather"] == pytest.approx(ex.etp_dispatch[0])
    for kind in (
        "combine-reduce_scatter",
        "combine-grad-all_gather",
        "dispatch-grad-reduce_scatter",
    ):
        assert sent[kind] == pytest.approx(ex.etp_bytes[0])


def test_a_one_gpu_deepep_call_moves_nothing():
    comm, group = nccl_system(2, {"kind": "fully_connected", "bandwidth": 1e10})
    p = comm.plan_uneven((group[0],), ((5.0,),), "deepep")
    assert p.streams == [] and p.bandwidth_time == 0.0
    # a table of the same bytes, built again, finds the same plan (a Chakra replay)
    sizes = tuple(tuple(1e6 * (i != j) for j in range(2)) for i in range(2))
    again = tuple(tuple(1e6 * (i != j) for j in range(2)) for i in range(2))
    assert comm.plan_uneven(tuple(group), sizes) is comm.plan_uneven(tuple(group), again)


def test_a_symmetric_deepep_run_with_tp_inside_ep_across_nodes_is_the_exact_run():
    """16 GPUs, nodes of 4, tp 2 x dp_replicate 8, ep 8 with DeepEP (Megatron-Bridge's
    DeepSeek-V3 layout in small): EP rank r is local index r, on node r // 4, and DeepEP's
    bytes between ranks depend on their nodes (one copy a node, forwarded over NVLink). The
    EP group's all-to-all runs whole at its representative, so shifting EP ranks, across a
    node's edge too, maps every GPU's streams to another's: one representative of 16, its
    iteration and bytes the exact run's."""
    from tests.test_ep_tp import trace

    cfg = {
        "num_gpus": 16,
        "batch_size": 16,
        "parallelism": {"mode": "mesh", "tp": 2, "dp_replicate": 8, "ep": 8,
                        "sequence_parallel": True, "dispatcher": "deepep"},
        "topology": {"kind": "multi_node", "gpus_per_node": 4, "bandwidth": 1e11,
                     "latency": 1e-6, "inter_bandwidth": 1e10, "inter_latency": 2e-6},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "roofline"},
    }  # fmt: skip
    tr = trace(layers=2, experts=8, top_k=2)
    exact = Simulation({**cfg, "symmetry": "off"}, trace=tr).run()
    sym = Simulation({**cfg, "symmetry": "auto"}, trace=tr).run()
    assert sym.symmetry == "auto: 1 representative of 16 GPUs"
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    assert sym.bytes_delivered == pytest.approx(exact.bytes_delivered, rel=1e-12)
    links = exact.per_link().merge(sym.per_link(), on=["src", "dst"])
    assert (links.nbytes_x - links.nbytes_y).abs().max() == 0.0


def test_an_equal_table_in_another_object_is_planned_once_and_hashed_once():
    """A mode's combine table can equal its dispatch's without being the same object: its
    plan is the first one's, and later calls with it find it by the object (a 64 x 64
    table hashed at each of thousands of calls was a twentieth of a MoE run)."""
    comm, group = nccl_system(8, {"kind": "multi_node", "gpus_per_node": 4})
    hashed = []

    class Table(tuple):
        def __hash__(self):
            hashed.append(1)
            return super().__hash__()

    rows = [tuple(1e6 * (i != j) * (1 + i) for j in range(8)) for i in range(8)]
    first = comm.plan_uneven(tuple(group), tuple(rows))
    other = Table(rows)
    assert comm.plan_uneven(tuple(group), other) is first
    n = len(hashed)
    for _ in range(3):
        assert comm.plan_uneven(tuple(group), other) is first
    assert len(hashed) == n
