"""Expert parallelism with tensor parallelism and the distributed optimizer (mode `ep` with
`tp`, `etp`, `distributed_optimizer`): a tiny EP x TP layer's collectives against a
timeline computed by hand, Megatron-Core's groups, conservation on random layouts
(hypothesis), ZeRO-1 memory by hand, tp = 1 unchanged, and the degree checks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extrapolators.modes.mesh.dims import Mesh
from extrapolators.modes.mesh.experts import ExpertMesh
from triosim import Simulation
from triosim.common.errors import ConfigError
from triosim.trace.model import Operator, Tensor, Trace

GB = 1e9
B, L = 10 * GB, 2e-6  # every link of the fully connected topology
T, H = 4096, 1024  # tokens in the traced batch (2 sequences), hidden
TB = H * 2  # one token's hidden state, bfloat16
WQ = WO = H * H * 2.0  # the attention's two linears (bf16)
ROUTER, EXPERT = 8 * H * 2.0, 64e6  # router weight; all experts of a layer together


def trace(layers=1, experts=2, top_k=1, batch=2, ffn=512):
    """`layers` blocks of: wq (column) -> wo (row) -> router -> grouped experts, each
    operator's backward paired with it, one optimizer operator. FLOPs = time x 1e12."""
    tensors, ops = {}, []

    def add(cat, nbytes, shape, name=None):
        t = Tensor(len(tensors), shape, "bfloat16", float(nbytes), cat, name)
        tensors[t.id] = t
        return t.id

    act = (batch, T // batch, H)
    x = add("input", T * TB, act)
    fwd = []
    for i in range(layers):
        p = f"layers.{i}"
        spec = [
            ("aten::linear", f"{p}.attention.wq", WQ, (H, H), 2e-3),
            ("aten::linear", f"{p}.attention.wo", WO, (H, H), 2e-3),
            ("aten::linear", f"{p}.feed_forward.router", ROUTER, (8, H), 1e-3),
            ("aten::bmm", f"{p}.feed_forward.experts", EXPERT / layers, (experts, H, ffn), 4e-3),
        ]
        for name, layer, wbytes, wshape, t in spec:
            w = add("weight", wbytes, wshape, f"{layer}.weight")
            y = add("activation", T * TB, act)
            ops.append(
                Operator(len(ops), name, layer, "forward", t, (x, w), (y,), t * 1e12, tp_split=True)
            )
            fwd.append((ops[-1], (x, w)))
            x = y
    grads = []
    for op, (a, w) in reversed(fwd):
        g = add("gradient", tensors[w].nbytes, tensors[w].shape)
        ga = add("activation", T * TB, act)
        grads.append(g)
        t = 2 * op.time
        ops.append(
            Operator(
                len(ops),
                op.name + "Backward",
                op.layer,
                "backward",
                t,
                (a, w),
                (ga, g),
                t * 1e12,
                fwd_id=op.id,
                tp_split=True,
            )
        )
    weights = tuple(t.id for t in tensors.values() if t.category == "weight")
    ops.append(
        Operator(len(ops), "aten::_foreach_add_", "optimizer", "optimizer", 3e-3, weights, ())
    )
    moe = {
        "expert_module": "feed_forward.experts",
        "num_experts": experts,
        "top_k": top_k,
        "hidden": H,
        "expert_ffn": ffn,
        "tokens": T,
        "capacity": T * top_k / experts,
        "capacity_factor": None,
        "dispatch_dtype": "bfloat16",
    }
    return Trace(ops, tensors, {"batch_size": batch, "gpu": "H100-SXM", "moe": moe}).validate()


def run(n, tr=None, batch=None, latency=L, **par):
    cfg = {
        "num_gpus": n,
        "batch_size": batch or n,
        "parallelism": {"mode": "ep", **par},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": latency},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "roofline"},
        "memory": {"precision": "mixed", "optimizer": "adam"},
    }
    sim = Simulation(cfg, trace=tr or trace())
    return sim, sim.run()


def ring(op, nbytes, g):
    """Textbook ring on g GPUs, one link per hop: all-reduce 2(g-1)/g, the others (g-1)/g."""
    k = 2 if op == "allreduce" else 1
    return k * (g - 1) / g * nbytes / B + k * (g - 1) * L


def collective_link_bytes(rows, ex, ep) -> float:
    """Bytes the links carry for the collectives among timeline `rows` (each collective once:
    its members' rows share one key): an all-to-all its off-diagonal per-pair sizes (the
    dispatch's and combine gradient's `ex.experts.sizes`, the others' `ex.experts.back`); a ring collective
    of n members n x (n - 1) / n of its bytes, twice for an all-reduce."""
    want = 0.0
    coll = rows.drop_duplicates("key")
    for name, key, nbytes in zip(coll["name"], coll["key"], coll["nbytes"], strict=True):
        members = rows[rows.key == key].gpu.nunique()
        if name == "all_to_all":
            sizes = (
                ex.experts.sizes
                if key.endswith((":dispatch", ":combine-grad"))
                else ex.experts.back
            )
            want += sum(sizes[i][j] for i in range(ep) for j in range(ep) if i != j)
        else:
            k = 2 if name == "allreduce" else 1
            want += members * k * (members - 1) / members * nbytes
    return want


class Grid:
    """GPU indices over the mesh's default order (tp-cp-dp-pp: rank i is GPU i) and the
    expert mesh folded out of it: groups as GPU indices in rank order."""

    def __init__(self, n, tp=1, ep=1, etp=1, pp=1):
        self.mesh = Mesh(pp=pp, dp_replicate=n // (pp * tp), tp=tp)
        self.ex = ExpertMesh(self.mesh, ep, etp)
        self.s, self.dp, self.edp = self.mesh.stage_size, n // (pp * tp), self.ex.edp

    def _ids(self, coords):
        return tuple(sorted(self.mesh.rank(c) for c in coords))

    def tp_group(self, i):
        return self._ids(self.mesh.members(self.mesh.coords(i), ("tp",)))

    def dp_group(self, i):
        return self._ids(self.mesh.members(self.mesh.coords(i), ("dp_replicate",)))

    def __getattr__(self, name):  # ep_group, etp_group, edp_group: rank order kept
        f = getattr(self.ex, name)
        return lambda i: tuple(self.mesh.rank(c) for c in f(self.mesh.coords(i)))

    def stage(self, i):
        return self.mesh.coords(i)[0]

    def expert(self, i):
        return self.ex.ranks(self.mesh.coords(i))


def test_megatron_core_groups():
    """parallel_state's order tp-cp-ep-dp-pp on 8 GPUs, tp 2: dense TP groups of 2
    consecutive GPUs, dense DP every 2nd; experts ep 2 x etp 2 (edp 2): expert-TP groups of
    2 consecutive, EP groups stride 2, expert replicas stride 4."""
    g = Grid(8, tp=2, ep=2, etp=2)
    assert (g.dp, g.edp) == (4, 2)
    assert g.tp_group(5) == (4, 5) and g.dp_group(5) == (1, 3, 5, 7)
    assert g.etp_group(5) == (4, 5) and g.ep_group(5) == (5, 7) and g.edp_group(5) == (1, 5)
    g = Grid(8, tp=2, ep=4, etp=1)  # EP carved out of DP x TP: 4 consecutive GPUs
    assert g.ep_group(6) == (4, 5, 6, 7) and g.edp_group(6) == (2, 6)
    assert g.tp_group(6) == (6, 7) and g.dp_group(6) == (0, 2, 4, 6)


def test_tiny_ep_tp_layer_by_hand():
    """4 GPUs, tp 2 (dp 2), ep 2, etp 1, 2 experts top-1, global batch 4: a replica's
    micro-batch is the traced 2 sequences (T tokens), each GPU holds T/2 of them (sequence
    parallel). Per GPU, on the compute stream, in order: all-gather of wq's input (T x H
    x 2 bytes, the TP group), reduce-scatter of wo's output (the same), the dispatch and
    combine all-to-alls (each sends the other EP rank half its T/2 tokens: T/4 x H x 2),
    in backward the two all-to-alls, all-gather of wo's output gradient, all-gather of
    wq's input again (its weight gradient); then the dense gradients it holds (router +
    wq/2 + wo/2) all-reduced over its dense DP group {0, 2}, its expert's (EXPERT/2) over
    its replicas {0, 2}, and after them the router weight's gradient over the TP group (it
    saw half the sequence), in the order of Megatron-Core's finalize_model_grads (DP's
    finish_grad_sync, then the sequence-parallel weights' all-reduce). Compute times come from the model; the
    iteration is their sum plus the hand-computed collectives (nothing overlaps)."""
    sim, r = run(4, tp=2, ep=2)
    tl = r.timeline
    g0 = tl[tl.gpu == 0]
    comm = g0[g0.kind == "comm"]
    act = T * TB
    a2a = T / 4 * TB / B + L  # one transfer each way, on its own link
    want = [
        ("all_gather", act, ring("all_gather", act, 2)),
        ("reduce_scatter", act, ring("reduce_scatter", act, 2)),
        ("all_to_all", T / 2 * TB, a2a),
        ("all_to_all", T / 2 * TB, a2a),
        ("all_to_all", T / 2 * TB, a2a),
        ("all_to_all", T / 2 * TB, a2a),
        ("all_gather", act, ring("all_gather", act, 2)),
        ("all_gather", act, ring("all_gather", act, 2)),
        ("allreduce", ROUTER + WQ / 2 + WO / 2, ring("allreduce", ROUTER + WQ / 2 + WO / 2, 2)),
        ("allreduce", EXPERT / 2, ring("allreduce", EXPERT / 2, 2)),
        ("allreduce", ROUTER, ring("allreduce", ROUTER, 2)),
    ]
    comm = comm.sort_values("start")
    assert list(comm["name"]) == [w[0] for w in want]
    assert comm["nbytes"].to_numpy() == pytest.approx([w[1] for w in want])
    assert (comm["end"] - comm["start"]).to_numpy() == pytest.approx([w[2] for w in want])
    assert len(set(comm["key"])) == len(comm)
    compute = g0[g0.kind == "compute"]
    busy = float((compute["end"] - compute["start"]).sum())
    assert r.iteration_time == pytest.approx(busy + sum(w[2] for w in want), rel=1e-9)
    ex = sim.extrapolator
    assert ex.held_weight_bytes(0) == pytest.approx(ROUTER + WQ / 2 + WO / 2 + EXPERT / 2)


def test_expert_tp_gathers_the_received_tokens():
    """etp 2 = tp 2, ep 2 on 4 GPUs: an EP group is GPUs {0, 2} (stride etp), an expert-TP
    group {0, 1}; after the dispatch each GPU all-gathers what both ranks of its expert-TP
    group received (2 x T/2 x H x 2 bytes), reduce-scatters it before the combine, and the
    same in backward; the expert gradients are 1/(ep x etp) of the experts, with no replica
    (edp 1)."""
    sim, r = run(4, tp=2, ep=2, etp=2)
    tl = r.timeline
    c = tl[(tl.gpu == 0) & (tl.kind == "comm")]
    etp = c[c["key"].astype(str).str.startswith("etp")]
    assert list(etp["name"]) == ["all_gather", "reduce_scatter"] * 2
    assert etp["nbytes"].to_numpy() == pytest.approx([2 * T / 2 * TB] * 4)
    a2a = c[c["name"] == "all_to_all"]
    assert set(a2a["key"].str.split(":").str[1]) == {"p0d0e0"}
    assert sim.extrapolator.expert_group(0, "ep") == (0, 2)
    assert not c["key"].astype(str).str.contains("experts0").any()  # edp 1: nothing to reduce
    assert sim.extrapolator.held_weight_bytes(0) == pytest.approx(
        ROUTER + WQ / 2 + WO / 2 + EXPERT / 4
    )


def test_distributed_optimizer_memory_and_collectives_by_hand():
    """ZeRO-1 (Megatron's distributed optimizer), mixed precision Adam: weights and
    gradients whole (2 bytes a parameter each; the gradients live in the contiguous
    gradient buffer, each main_grad a view of it: counted as the buffer, no gradient
    tensor), the fp32 master weights and Adam moments (12 bytes a parameter) of 1/dp of
    the dense weights the GPU holds and 1/edp of its experts'; the gradients are reduce-
    scattered, the parameters all-gathered after the step, over the same groups and
    bytes."""
    sim, r = run(8, trace(experts=4), batch=8, tp=2, ep=4, distributed_optimizer=True)
    dense = ROUTER + WQ / 2 + WO / 2  # dp = 8 / 2 = 4
    expert = EXPERT / 4  # edp = 8 / 4 = 2
    mem = r.memory[r.memory["gpu"] == 0]
    assert mem["weights"].max() == pytest.approx(dense + expert)
    assert mem["gradients"].max() == 0
    assert sim.extrapolator.buffer_bytes(0) == pytest.approx(dense + expert)
    assert mem["optimizer_states"].max() == pytest.approx(6 * (dense / 4 + expert / 2))
    tl = r.timeline
    keys = tl["key"].astype(str)
    c = tl[(tl.gpu == 0) & (tl.kind == "comm") & keys.str.match("dp:|params:")]
    got = sorted(zip(c["name"], c["nbytes"], strict=True))  # bytes are sums of exact sizes
    assert got == sorted(
        [
            ("reduce_scatter", dense),
            ("reduce_scatter", expert),
            ("all_gather", dense),
            ("all_gather", expert),
        ]
    )
    dur = dict(zip(c["key"], c["end"] - c["start"], strict=True))
    assert dur["dp:p0t0"] == pytest.approx(ring("rs", dense, 4))
    assert dur["params:experts0.0p0"] == pytest.approx(ring("ag", expert, 2))


def test_tp_1_is_mode_ep():
    """tp = etp = 1 and no distributed optimizer is the mode as it was: the same timeline."""
    tr = trace(experts=4, top_k=2)
    _, a = run(4, tr, ep=2)
    _, b = run(4, tr, ep=2, tp=1, etp=1, sequence_parallel=True, distributed_optimizer=False)
    assert a.iteration_time == b.iteration_time
    assert a.timeline.equals(b.timeline)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    etp=st.sampled_from([1, 2]),
    edp=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    zero=st.sampled_from(["none", "distributed_optimizer", "fsdp"]),
    skew=st.sampled_from([0.0, 1.5]),
)
def test_conservation_on_random_layouts(tp, ep, etp, edp, top_k, zero, skew):
    """Random tp / ep / etp layouts (n = etp x ep x edp, tp dividing n), uniform or skewed
    loads, gradients all-reduced, ZeRO-1 or FSDP: every operator of
    the trace runs once on every GPU; every routed token is dispatched once (the all-to-
    alls' sizes sum to the tokens of its EP group x top_k x H x 2, the groups together all
    GPUs' tokens); the bytes on the links are the collectives' textbook bytes, each
    collective counted once; each weight's gradient is reduced over groups that together
    hold it once."""
    n = etp * ep * edp
    if n % tp or n < 2:
        return
    experts = 4
    tr = trace(experts=experts, top_k=top_k, ffn=512)
    load = {"load": "skew", "skew": skew, "seed": 1} if skew else {}
    if zero != "none":
        load[zero] = True
    sim, r = run(n, tr, batch=2 * n // tp, tp=tp, ep=ep, etp=etp, **load)
    ex = sim.extrapolator
    tl = r.timeline
    fb = [o.id for o in tr.operators if o.phase != "optimizer"]
    comp = tl[tl.kind == "compute"]
    for g in range(n):
        ids = sorted(comp[comp.gpu == g]["op_id"].astype(int))
        assert ids == sorted([*fb, *(o.id for o in tr.operators if o.phase == "optimizer")])
    # tokens: each GPU holds T (the traced 2 sequences' tokens, here a replica's 2 x T
    # split over tp) and routes them top_k times
    per_gpu = T / tp  # a replica's micro-batch is the traced one, split over tp
    assert sum(map(sum, ex.experts.sizes)) == pytest.approx(ep * per_gpu * top_k * TB)
    # the links: each collective once (its members' rows share one key)
    want = collective_link_bytes(tl[tl.kind == "comm"], ex, ep)
    links = r.per_link()["nbytes"].sum() if len(r.per_link()) else 0.0
    assert links == pytest.approx(want, rel=1e-9, abs=1e-6)
    # gradients: the dense groups hold the dense weights once, the expert groups once
    dense_groups = {ex.dense_group(g) for g in range(n)}
    assert sorted(g for grp in dense_groups for g in grp) == list(range(n))
    replicas = {ex.expert_group(g, "edp") for g in range(n)}
    assert len(replicas) * ex.weights.expert_bytes[0] == pytest.approx(EXPERT)


@pytest.mark.parametrize(
    "n, par, field, words",
    [
        (4, {"tp": 3}, "parallelism.tp", "dividing num_gpus (4)"),
        (4, {"tp": 2, "ep": 2, "etp": 4}, "parallelism.ep", "ep x etp (2 x 4)"),
        (8, {"ep": 4, "etp": 2, "tp": 2}, "parallelism.ep", "of the 2 experts"),
        (4, {"ep": 2, "etp": 2, "tp": 2}, "parallelism.etp", "FFN width (511)"),
        (
            4,
            {"ep": 2, "tp": 2, "sequence_parallel": False},
            "parallelism.sequence_parallel",
            "True",
        ),
    ],
)
def test_degree_checks_name_field_degree_and_counts(n, par, field, words):
    tr = trace(ffn=511 if par.get("etp") == 2 and n == 4 else 512)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        run(n, tr, **par)
    text = str(e.value)
    if words != "True":
        assert words in text, text
    else:
        assert "sequence parallelism must be used" in text


@pytest.mark.no_cover
def test_traced_mixtral_with_tp_splits_attention_not_experts():
    """The tiny Mixtral's CPU trace (4 query heads, 2 key/value heads): tp 4 is refused,
    naming the field, the degree and the head counts; at tp 2 x ep 2 the attention's
    projections are column/row-parallel, the router and the routed experts have no TP role
    (the router on 1/tp of the sequence), and each all-to-all carries the GPU's half of a
    replica's tokens x top_k x hidden x 2 bytes."""
    pytest.importorskip("torch")
    from tracer.cli import trace_model

    tr = trace_model("mixtral-8x7b", 4, small=True, seq_len=8, warmup=1, measure=1)
    moe = tr.metadata["moe"]
    topo = {"kind": "switch", "bandwidth": "50 GB/s", "latency": "1 us"}
    cfg = {"num_gpus": 4, "batch_size": 8, "topology": topo}
    with pytest.raises(ConfigError, match=r"parallelism\.tp") as e:
        Simulation({**cfg, "parallelism": {"mode": "ep", "tp": 4}}, trace=tr)
    assert "2 key/value heads" in str(e.value) and "4" in str(e.value)
    sim = Simulation({**cfg, "parallelism": {"mode": "ep", "tp": 2, "ep": 2}}, trace=tr)
    r = sim.run()
    tpx = sim.extrapolator.tpx
    by_layer = {}
    for op in tr.operators:
        if op.phase == "forward" and op.name == "aten::linear":
            by_layer[op.layer] = tpx.roles.get(op.id)
    assert by_layer["layers.0.attention.wq"] == "column"
    assert by_layer["layers.0.attention.wo"] == "row"
    assert by_layer["layers.0.feed_forward.router"] == "sequence"
    expert = [o for o in tr.operators if o.layer.endswith("feed_forward.experts")]
    assert all(o.id not in tpx.roles for o in expert)
    tl = r.timeline
    a2a = tl[(tl.gpu == 0) & (tl.name == "all_to_all")]
    assert len(a2a) == 4 * moe["moe_layers"]
    # batch 8 over dp 2: a replica's 4 sequences = the traced tokens; half on each TP rank
    assert a2a["nbytes"].to_numpy() == pytest.approx(
        moe["tokens"] / 2 * moe["top_k"] * moe["hidden"] * 2
    )


def test_overlapped_parameter_gather_exposes_only_the_first_bucket():
    """--overlap-param-gather: the dense shards (router + wq/2 + wo/2, one bucket) are
    gathered before wq's forward, the experts' (EXPERT/2) while the attention and router
    run, done before the experts need them; so the iteration is the non-overlapped one
    less the expert gather's time (by hand), and GPU 0's first operator starts when the
    dense gather and wq's input all-gather end. Without the distributed optimizer the option is refused."""
    par = dict(tp=2, ep=2, distributed_optimizer=True, bucket_size=1e12)
    _, plain = run(4, **par)
    _, over = run(4, overlap_param_gather=True, **par)
    dense, expert = ROUTER + WQ / 2 + WO / 2, EXPERT / 2
    assert over.iteration_time == pytest.approx(
        plain.iteration_time - ring("ag", expert, 2), rel=1e-9
    )
    tl = over.timeline
    g0 = tl[tl.gpu == 0]
    gathers = g0[g0["key"].astype(str).str.startswith("params:")].sort_values("start")
    assert list(gathers["nbytes"]) == [dense, expert]
    # then wq's input all-gathered over the TP group (sequence parallel), then wq
    first = ring("ag", dense, 2) + ring("all_gather", T * TB, 2)
    assert g0[g0.kind == "compute"]["start"].min() == pytest.approx(first)
    with pytest.raises(ConfigError, match=r"parallelism\.overlap_param_gather"):
        run(4, tp=2, ep=2, overlap_param_gather=True)


def test_overlapped_buckets_hold_the_gpus_share():
    """dp_overlap with tp 2: a bucket per weight (1-byte caps), each the share a GPU holds:
    the router whole, wq and wo half (column and row split), the experts 1/ep; reduced over
    the dense group {0, 2} and the expert replicas {0, 2}."""
    sim, r = run(4, tp=2, ep=2, dp_overlap=True, bucket_size=1.0, first_bucket_size=1.0)
    sizes = sorted((kind, size) for _, size, kind in sim.extrapolator.buckets[0])
    assert sizes == sorted(
        [("dense", ROUTER), ("dense", WQ / 2), ("dense", WO / 2), ("expert", EXPERT / 2)]
    )
    tl = r.timeline
    rows = tl[(tl.kind == "comm") & tl["key"].astype(str).str.contains(":bucket")]
    assert set(rows[rows["key"].str.startswith("dp:p0t0")]["gpu"]) == {0, 2}
    assert set(rows[rows["key"].str.startswith("dp:experts0.0p0")]["gpu"]) == {0, 2}


def test_fsdp_gathers_each_unit_twice_and_reduce_scatters_it_once():
    """ZeRO-3 with tp 2 x ep 2 on 4 GPUs: the units are the four layers (wq, wo, router,
    experts); GPU 0 all-gathers each unit's held bytes (wq/2, wo/2 and the router over its
    dense replicas {0, 2}, the experts' EXPERT/2 over its expert replicas {0, 2}) before
    the unit's forward and again before its backward, and reduce-scatters them once after
    the unit's backward; it keeps 1/2 of each (weights, gradients, AdamW's 12 bytes a
    parameter: 6x); every expert operator starts after the experts' gather ends; with the
    distributed optimizer the option is refused."""
    sim, r = run(4, tp=2, ep=2, fsdp=True, wrap_depth=4)  # (the default: layers.N whole)
    tl = r.timeline
    g0 = tl[(tl.gpu == 0) & (tl.kind == "comm")]
    units = [WQ / 2, WO / 2, ROUTER, EXPERT / 2]
    fsdp = g0[g0["key"].str.startswith("fsdp:")]
    gathers = fsdp[fsdp.name == "all_gather"].sort_values("start")
    assert list(gathers["nbytes"]) == units + units[::-1]
    assert set(tl[tl["key"] == "fsdp:experts0.0p0:0:forward:0.3"]["gpu"]) == {0, 2}
    assert set(tl[tl["key"] == "fsdp:p0r0t0:0:forward:0.0"]["gpu"]) == {0, 2}
    scatters = fsdp[fsdp["key"].str.contains(":grads:")]
    assert sorted(scatters["nbytes"]) == sorted(units)
    assert set(scatters["name"]) == {"reduce_scatter"}
    keep = (ROUTER + WQ / 2 + WO / 2) / 2 + (EXPERT / 2) / 2
    mem = r.memory[r.memory["gpu"] == 0]
    assert mem["weights"].max() == pytest.approx(keep)
    assert mem["gradients"].max() == pytest.approx(keep)
    assert mem["optimizer_states"].max() == pytest.approx(6 * keep)
    ex_gather = gathers[gathers["key"] == "fsdp:experts0.0p0:0:forward:0.3"]["end"].iloc[0]
    c0 = tl[(tl.gpu == 0) & (tl.kind == "compute")]
    assert c0[c0["layer"].str.endswith("experts")]["start"].min() >= ex_gather - 1e-12
    with pytest.raises(ConfigError, match=r"parallelism\.fsdp"):
        run(4, tp=2, ep=2, fsdp=True, wrap_depth=4, distributed_optimizer=True)


def test_tp_needs_the_moe_layers_module():
    """With tp > 1 the experts' module must sit under its MoE layer's (the router is told
    from the attention by that module): a bare `experts` is refused, naming the field."""
    tr = trace()
    tr.metadata["moe"] = {**tr.metadata["moe"], "expert_module": "experts"}
    run(4, tr, ep=2)  # tp 1 does not need it
    with pytest.raises(ConfigError, match=r"metadata moe\.expert_module"):
        run(4, tr, tp=2, ep=2)
