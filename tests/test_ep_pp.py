"""Expert parallelism with pipeline parallelism (mode `ep` with `pp`, the mesh's pipeline): a
tiny pp 2 x ep 2 run against its collectives, sends and 1F1B timeline computed by hand,
per-stage memory by hand, Megatron-Core's grid with PP outermost, pp 1 unchanged,
conservation on random pp / ep / tp / etp layouts (hypothesis), and the degree checks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ep_tp import (
    EXPERT,
    ROUTER,
    TB,
    WO,
    WQ,
    B,
    Grid,
    L,
    T,
    collective_link_bytes,
    ring,
    run,
    trace,
)

from triosim.common.errors import ConfigError

MB_TOKENS = T / 2  # batch 4 over dp 2 and 2 micro-batches: one of the traced 2 sequences
UNIT = MB_TOKENS * TB  # one micro-batch's activation on one GPU: T/2 x H x 2 bytes


def test_megatron_core_grid_with_pp_outermost():
    """parallel_state's order tp-cp-ep-dp-pp on 16 GPUs, pp 2, tp 2, ep 2, etp 1: stage 1 is
    GPUs 8..15; inside it the groups are those of 8 GPUs shifted by 8; dp = 16 / (2 x 2),
    edp = 16 / (2 x 2) (Megatron-Core: world // (etp x ep x pp)); GPU 13's pipeline peer in
    stage 0 is GPU 5."""
    g = Grid(16, tp=2, ep=2, etp=1, pp=2)
    assert (g.s, g.dp, g.edp) == (8, 4, 4)
    assert g.stage(13) == 1 and g.mesh.rank((0, *g.mesh.coords(13)[1:])) == 5
    assert g.tp_group(13) == (12, 13) and g.dp_group(13) == (9, 11, 13, 15)
    assert g.ep_group(13) == (12, 13) and g.edp_group(13) == (9, 11, 13, 15)
    assert g.mesh.coords(13)[4] == 1 and g.expert(13) == (0, 1, 2)
    one = Grid(8, tp=2, ep=2, etp=1)
    for i in range(8):  # stage 1 is stage 0 shifted by 8
        for f in ("tp_group", "dp_group", "ep_group", "etp_group", "edp_group"):
            assert getattr(g, f)(i + 8) == tuple(k + 8 for k in getattr(one, f)(i))


def test_tiny_pp2_ep2_by_hand():
    """4 GPUs, pp 2 x ep 2 (tp 1, edp 1), 2 layers of wq -> wo -> router -> 2 experts top-1,
    global batch 4, 2 micro-batches, 1F1B. Stage 0 = GPUs {0, 1} holds layers.0, stage 1 =
    {2, 3} layers.1 (the balanced cut of two equal layers). Each GPU's micro-batch is T/2
    tokens (batch 4 / dp 2 / 2 micro-batches: one sequence); its all-to-all buffer is T/2 x
    top-1 x H x 2 bytes, half of it to the other EP rank of its stage (one transfer each
    way, a: (T/4 x H x 2) / B + L), 4 per layer and micro-batch, on the stage's EP group;
    GPU 0 sends GPU 2 (its pipeline peer) each micro-batch's activation, T/2 x H x 2 bytes
    (s = UNIT / B + L), GPU 2 sends the gradient back. After the schedule each GPU
    all-reduces its stage's dense weights (router + wq + wo) over its stage's dense DP
    group {0, 1} or {2, 3}; the experts (EXPERT / 2 layers / 2 EP ranks) have one replica.

    The 1F1B timeline by hand, with F_p / B_p the compute of one micro-batch's forward /
    backward on stage p (read from the timeline) plus its 2 all-to-alls: stage 0 runs F0
    F1 back to back; stage 1 gets act0 at F_0 + s, runs F0 B0 (ends e2), then F1 once act1
    (2 F_0 + s) is there, B1 (ends e4); stage 0's B0 starts when B0's gradient arrives
    (e2 + s), B1 when B1's does (e4 + s); then the all-reduce r and the optimizer."""
    tr = trace(layers=2, experts=2)
    sim, r = run(4, tr, batch=4, pp=2, ep=2, accumulation_steps=2)
    ex, tl = sim.extrapolator, r.timeline
    a = UNIT / 2 / B + L
    s = UNIT / B + L
    dense = ROUTER + WQ + WO
    red = ring("allreduce", dense, 2)
    # GPU 0's compute stream (stage 0: F0 F1 B0 B1), its sends and its reduction, in order
    layer0 = "layers.0.feed_forward.experts"
    want = {"compute": [], "send_fwd": [], "dp": [("allreduce", dense, "dp:p0t0")]}
    for kind, m in (("F", 0), ("F", 1), ("B", 0), ("B", 1)):
        if kind == "B":
            want["compute"].append(("recv from 2", 0.0, f"r0s0c0t0/grad1.{m}"))
        tags = ("dispatch", "combine") if kind == "F" else ("combine-grad", "dispatch-grad")
        want["compute"] += [("all_to_all", UNIT, f"ep:p0d0e0:m{m}:{layer0}:{k}") for k in tags]
        if kind == "F":
            want["send_fwd"].append(("send to 2", UNIT, f"r0s0c0t0/act0.{m}"))
    recv = tl.name.astype(str).str.startswith("recv from")  # a receive is a wait
    c0 = tl[(tl.gpu == 0) & ((tl.kind == "comm") | recv)].sort_values("start")
    assert set(c0.stream) == set(want)
    for stream, rows in want.items():
        got = c0[c0.stream == stream]
        assert list(zip(got["name"], got["key"], strict=True)) == [(x, k) for x, _, k in rows]
        assert got["nbytes"].to_numpy() == pytest.approx([x for _, x, _ in rows])
    # every all-to-all is on the stage's EP group; its sizes: half the buffer each way
    for g in range(4):
        assert ex.expert_group(g, "ep") == ((0, 1) if g < 2 else (2, 3))
    assert [list(x) for x in ex.experts.sizes] == [[UNIT / 2, UNIT / 2], [UNIT / 2, UNIT / 2]]
    dur = tl[tl.kind == "comm"]
    for name, want in (("all_to_all", a), ("send to 2", s), ("send to 0", s), ("allreduce", red)):
        rows = dur[dur.name == name]
        assert len(rows) > 0
        assert (rows["end"] - rows["start"]).to_numpy() == pytest.approx(want, rel=1e-9)
    # the 1F1B timeline
    comp = tl[tl.kind == "compute"]

    def busy(gpu, phase, mb=0):
        x = comp[(comp.gpu == gpu) & (comp.phase == phase) & (comp.microbatch == mb)]
        return float((x["end"] - x["start"]).sum())

    F0, B0 = busy(0, "forward") + 2 * a, busy(0, "backward") + 2 * a
    F1, B1 = busy(2, "forward") + 2 * a, busy(2, "backward") + 2 * a
    assert busy(0, "forward", 1) == pytest.approx(busy(0, "forward"))
    e2 = F0 + s + F1 + B1
    e4 = max(e2, 2 * F0 + s) + F1 + B1
    b0 = max(2 * F0, e2 + s) + B0
    b1 = max(b0, e4 + s) + B0
    opt0, opt1 = busy(0, "optimizer"), busy(2, "optimizer")
    assert opt0 == pytest.approx(opt1) and opt0 > 0
    end0, end2 = b1 + red + opt0, e4 + s + red + opt1
    assert tl[tl.gpu == 0]["end"].max() == pytest.approx(end0, rel=1e-9)
    assert tl[tl.gpu == 2]["end"].max() == pytest.approx(end2, rel=1e-9)
    assert r.iteration_time == pytest.approx(max(end0, end2), rel=1e-9)


def test_stage_memory_by_hand():
    """Mixed precision Adam, the tiny pp 2 x ep 2 run: each GPU holds its stage's weights
    (one layer's router + wq + wo, and EXPERT / 2 layers / 2 EP ranks of experts), the same
    gradients and 6x them in optimizer states; with the distributed optimizer those states
    are 1/dp (2) of the dense and 1/edp (1) of the experts'. Activations, in units of one
    micro-batch's T/2 x H x 2 bytes: a stage's forward keeps 4 (its input and the outputs
    of wq, wo and the router, which the backward reads) and has its experts' output alive
    during the experts' forward; stage 0 runs F0 F1 before B0 (1F1B warm-up: 2 micro-
    batches in flight), so it peaks at 4 + 5 = 9, stage 1 (F0 B0 F1 B1: one in flight) at 5
    (4 + the experts' input gradient during their backward)."""
    tr = trace(layers=2, experts=2)
    held = ROUTER + WQ + WO + EXPERT / 2 / 2
    _, r = run(4, tr, batch=4, pp=2, ep=2, accumulation_steps=2)
    m = r.memory.groupby("gpu")[["weights", "gradients", "optimizer_states", "activations"]]
    peak = m.max()
    for g in range(4):
        assert peak.loc[g, "weights"] == pytest.approx(held)
        assert peak.loc[g, "gradients"] == pytest.approx(held)
        assert peak.loc[g, "optimizer_states"] == pytest.approx(6 * held)
    assert peak.loc[0, "activations"] == pytest.approx(9 * UNIT)
    assert peak.loc[2, "activations"] == pytest.approx(5 * UNIT)
    _, r = run(4, tr, batch=4, pp=2, ep=2, accumulation_steps=2, distributed_optimizer=True)
    states = r.memory.groupby("gpu")["optimizer_states"].max()
    assert states.to_numpy() == pytest.approx(6 * ((ROUTER + WQ + WO) / 2 + EXPERT / 4))
    # 3 layers on 2 stages: the stages hold different weights, each GPU its own stage's
    sim, r = run(4, trace(layers=3, experts=2), batch=4, pp=2, ep=2, distributed_optimizer=True)
    w = sim.extrapolator.weights
    held = list(zip(w.dense_bytes, w.expert_bytes, strict=True))
    assert held[0] != held[1]
    states = r.memory.groupby("gpu")["optimizer_states"].max()
    for g in range(4):
        dense, expert = held[g // 2]
        assert states[g] == pytest.approx(6 * (dense / 2 + expert / 1))


def test_pp_1_is_mode_ep():
    """pp 1 is the mode as it was (the same code path): the pipeline-only options change
    nothing, digit for digit, with tp, etp, accumulation and the distributed optimizer."""
    tr = trace(layers=2, experts=4, top_k=2)
    par = dict(tp=2, ep=2, accumulation_steps=2, distributed_optimizer=True)
    _, a = run(8, tr, batch=16, **par)
    _, b = run(8, tr, batch=16, pp=1, schedule="gpipe", **par)
    assert a.iteration_time == b.iteration_time
    assert a.timeline.equals(b.timeline)
    assert a.memory.equals(b.memory)


@pytest.mark.no_cover
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp=st.sampled_from([2, 3]),
    tp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2]),
    etp=st.sampled_from([1, 2]),
    edp=st.sampled_from([1, 2]),
    M=st.sampled_from([1, 2, 3]),
    sched=st.sampled_from(["1f1b", "gpipe", "interleaved"]),
    dist=st.booleans(),
)
def test_conservation_on_random_layouts(pp, tp, ep, etp, edp, M, sched, dist):
    """Random pp / tp / ep / etp layouts (a stage of etp x ep x edp GPUs, tp dividing it),
    M micro-batches, 1F1B, GPipe or interleaved (2 chunks a stage): every forward and
    backward operator runs M times in exactly one stage (its chunk c's, c % pp), on every GPU of that stage, each micro-batch once, the optimizer
    once per GPU; the all-to-alls stay inside the stage's EP group and every one a GPU
    joins its group's members join; every send has its receive (same key, the pipeline
    peer), M per boundary and direction and GPU, of boundary x micro-batch share / tp
    bytes; the bytes on the links are the collectives' textbook bytes plus the sends'; each
    stage's dense and expert weights are reduced over groups that hold them once, and the
    stages together hold every weight once."""
    s = etp * ep * edp
    v = 2 if sched == "interleaved" else 1  # 2 model chunks per stage
    if s % tp or (v > 1 and M % pp):
        return
    n = pp * s
    tr = trace(layers=3, experts=4, ffn=512)
    dp = s // tp
    batch = 2 * dp * M  # each replica's micro-batch is the traced 2 sequences
    extra = {"distributed_optimizer": True} if dist else {}
    sim, r = run(
        n, tr, batch=batch, pp=pp, tp=tp, ep=ep, etp=etp, accumulation_steps=M,
        schedule=sched, virtual_stages=v, **extra,
    )  # fmt: skip
    ex, tl = sim.extrapolator, r.timeline
    comp = tl[tl.kind == "compute"]
    pipe = ex.pipe
    stage_ops = [
        sorted(o.id for c in range(p, pp * v, pp) for o in pipe.fwd_ops[c] + pipe.bwd_ops[c])
        for p in range(pp)
    ]
    fb = sorted(o.id for o in tr.operators if o.phase != "optimizer")
    assert sorted(i for ops in stage_ops for i in ops) == fb
    opt = [o.id for o in tr.operators if o.phase == "optimizer"]
    for g in range(n):
        p = g // s
        mine = comp[comp.gpu == g]
        for m in range(M):
            ids = sorted(mine[(mine.microbatch == m) & (mine.phase != "optimizer")]["op_id"])
            assert ids == stage_ops[p]
        assert sorted(mine[mine.phase == "optimizer"]["op_id"]) == opt
    comm = tl[tl.kind == "comm"]
    a2a = comm[comm.name == "all_to_all"]
    for key, rows in a2a.groupby("key", observed=True):
        g = int(rows.gpu.iloc[0])
        assert sorted(rows.gpu) == sorted(ex.expert_group(g, "ep")), key
        assert all(x // s == g // s for x in rows.gpu)
    sends = comm[comm.name.astype(str).str.startswith("send to")]
    recvs = tl[tl.name.astype(str).str.startswith("recv from")]
    assert len(sends) == len(recvs) == n // pp * (pp * v - 1) * 2 * M  # per cut, both ways
    ratio = ex.pipe._mb_ratio() / tp
    for _, row in sends.iterrows():
        dst = int(str(row["name"]).split()[-1])
        at, coord = ex.layout.at, ex.layout.coord
        assert at[(coord[dst][0], *coord[int(row.gpu)][1:])] == dst  # its pipeline peer
        back = recvs[(recvs.key == row.key) & (recvs.gpu == dst)]
        assert len(back) == 1 and str(back["name"].iloc[0]) == f"recv from {int(row.gpu)}"
        tag = str(row.key).split("/")[1].split(".")[0]  # act{c}: chunk c's output
        c = int(tag[3:] if tag.startswith("act") else tag[4:])
        cut = c if tag.startswith("act") else c - 1
        assert dst // s == ((c + 1) % pp if tag.startswith("act") else (c - 1) % pp)
        assert row["nbytes"] == pytest.approx(ex.pipe.boundary[cut] * ratio)
    want = float(sends["nbytes"].sum())
    want += collective_link_bytes(
        comm[~comm.name.astype(str).str.contains("send to|recv from")], ex, ep
    )
    links = r.per_link()["nbytes"].sum() if len(r.per_link()) else 0.0
    assert links == pytest.approx(want, rel=1e-9, abs=1e-6)
    held = [0.0, 0.0]
    for p in range(pp):
        first = p * s
        dense_groups = {ex.dense_group(first + k) for k in range(s)}
        assert sorted(g for grp in dense_groups for g in grp) == list(range(first, first + s))
        replicas = {ex.expert_group(first + k, "edp") for k in range(s)}
        dense, expert = (ex.weights.dense_bytes[p], ex.weights.expert_bytes[p])
        held[0] += dense
        held[1] += len(replicas) * expert
    # wq and wo column / row split over the TP group, the router whole (Megatron's router)
    assert held[0] == pytest.approx(3 * (ROUTER + (WQ + WO) / tp))
    assert held[1] == pytest.approx(EXPERT)


@pytest.mark.parametrize(
    "n, par, field, words",
    [
        (6, {"pp": 4, "ep": 1}, "parallelism.pp", "dividing num_gpus (6)"),
        (8, {"pp": 2, "tp": 3}, "parallelism.tp", "num_gpus / pp (8 / 2 = 4)"),
        (8, {"pp": 2, "ep": 8}, "parallelism.ep", "ep x etp (8 x 1) dividing num_gpus / pp"),
        (8, {"pp": 2, "ep": 4, "etp": 2}, "parallelism.ep", "expert-TP x EP x PP"),
        (4, {"pp": 2, "ep": 2, "schedule": "zigzag"}, "parallelism.schedule", "1f1b"),
    ],
)
def test_degree_checks_name_field_degree_and_counts(n, par, field, words):
    """Each refused layout names its field, the degree and the counts it was checked
    against."""
    tr = trace(layers=2, experts=4)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        run(n, tr, batch=2 * n, **par)
    assert words in str(e.value), str(e.value)


def test_overlapped_buckets_per_stage():
    """dp_overlap with pp 2 x ep 1 on 4 GPUs (edp 2), 1-byte buckets: each stage buckets
    its own layer's weights, one bucket each (router, wq, wo over the dense group, its
    experts' EXPERT / 2 over its expert replicas: the same two GPUs, {0, 1} or {2, 3}),
    each all-reduced once its last micro-batch's backward operator has made it, so on
    stage 0 the experts' bucket (their backward runs first) is reduced before wq's."""
    tr = trace(layers=2, experts=2)
    par = dict(pp=2, ep=1, accumulation_steps=2, dp_overlap=True)
    sim, r = run(4, tr, batch=4, bucket_size=1.0, first_bucket_size=1.0, **par)
    ex, tl = sim.extrapolator, r.timeline
    for p in range(2):
        got = sorted((kind, size) for _, size, kind in ex.buckets[p])
        want = [("dense", ROUTER), ("dense", WQ), ("dense", WO), ("expert", EXPERT / 2)]
        assert got == sorted(want)
    rows = tl[(tl.kind == "comm") & tl["key"].astype(str).str.contains(":bucket")]
    for g in range(4):
        mine = rows[rows.gpu == g].sort_values("start")
        assert len(mine) == 4 and set(mine.name) == {"allreduce"}
        for key in mine.key:
            assert set(rows[rows.key == key].gpu) == ({0, 1} if g < 2 else {2, 3})
    comp = tl[(tl.gpu == 0) & (tl.kind == "compute") & (tl.microbatch == 1)]
    mine = rows[rows.gpu == 0].sort_values("start")
    first = dict(zip(mine.nbytes, mine.start, strict=True))
    done = dict(zip(comp.layer, comp.end, strict=False))  # the backward's, later rows
    for layer, nbytes in (
        ("layers.0.feed_forward.experts", EXPERT / 2),
        ("layers.0.attention.wq", WQ),
    ):
        assert first[nbytes] >= done[layer] - 1e-12
    assert first[EXPERT / 2] < first[WQ]
    assert ex.buffer_bytes(0) == pytest.approx(ROUTER + WQ + WO + EXPERT / 2)


def test_overlapped_parameter_gathers_per_stage():
    """The distributed optimizer with overlap_param_gather, pp 2 x ep 1 on 4 GPUs (dp = edp
    = 2), one bucket of each kind: each GPU all-gathers its stage's dense shard (router +
    wq + wo) and its experts' (EXPERT / 2) over its stage's pair, the dense one before
    its first forward operator (wq's) starts, none after the step."""
    tr = trace(layers=2, experts=2)
    par = dict(pp=2, ep=1, accumulation_steps=2, distributed_optimizer=True)
    _, r = run(4, tr, batch=4, overlap_param_gather=True, bucket_size=1e12, **par)
    tl = r.timeline
    rows = tl[(tl.kind == "comm") & tl["key"].astype(str).str.startswith("params:")]
    for g in range(4):
        mine = rows[rows.gpu == g].sort_values("start")
        assert list(mine.nbytes) == pytest.approx([ROUTER + WQ + WO, EXPERT / 2])
        assert set(mine.name) == {"all_gather"} and set(mine.phase) == {"forward"}
        for key in mine.key:
            assert set(rows[rows.key == key].gpu) == ({0, 1} if g < 2 else {2, 3})
        comp = tl[(tl.gpu == g) & (tl.kind == "compute")]
        assert comp.start.min() >= mine.end.iloc[0] - 1e-12


def test_cuts_keep_each_moe_layer_on_one_stage():
    """With the router in the experts' layer (forward positions 2-3 and 6-7 of 8), a
    stage start inside those spans moves to just after them, one at a layer boundary
    stays, and stages that would then be empty are refused naming parallelism.pp."""
    import dataclasses

    tr = trace(layers=2, experts=4)
    for k, op in enumerate(tr.operators):
        if op.layer.endswith("feed_forward.router"):
            layer = op.layer.replace("router", "experts")  # 2 expert operators
            tr.operators[k] = dataclasses.replace(op, layer=layer)
    sim, r = run(4, tr, batch=4, pp=2, ep=2, accumulation_steps=2)
    ex = sim.extrapolator
    assert ex.experts.whole_layers(ex.ops("forward"), [0, 3]) == [0, 4]
    assert ex.experts.whole_layers(ex.ops("forward"), [0, 6]) == [0, 6]
    assert ex.experts.whole_layers(ex.ops("forward"), [0, 2, 5]) == [0, 2, 5]
    assert [len(ops) for ops in ex.pipe.fwd_ops] == [4, 4]
    with pytest.raises(ConfigError, match=r"parallelism\.pp") as e:
        ex.experts.whole_layers(ex.ops("forward"), [0, 3, 4])
    assert "[0, 4, 4] of 8" in str(e.value)
    with pytest.raises(ConfigError, match=r"parallelism\.pp"):
        run(8, tr, batch=16, pp=8, ep=1)  # one forward operator per stage


def test_interleaved_chunks_by_hand():
    """pp 2 x ep 2 with 2 virtual stages on 4 layers, 2 micro-batches: chunk c is layer c
    (4 equal layers), on stage c % 2, so GPU 0 (stage 0) runs chunks 0 and 2 and GPU 2
    chunks 1 and 3. Layer 2's output is made 2x larger here, so the cut after chunk 2
    carries 2 x T/2 x H x 2 bytes per micro-batch and the others T/2 x H x 2. GPU 0 sends
    chunk 0's activation (act0) and chunk 2's (act2, 2x) to GPU 2 for each micro-batch and
    chunk 2's input gradient (grad2) back to GPU 2; GPU 2 sends act1 and grad1, grad3 to
    GPU 0; interleaved 1F1B's order on stage 0 (Megatron: warm-up (pp - 1) x 2 + (v - 1)
    x pp = 4 forward chunk-steps, micro-batches in groups of pp through chunk 0, then
    chunk 1): F0 F1 on chunk 0, F0 F1 on chunk 2, then B0 B1 on chunk 2, B0 B1 on chunk
    0."""
    import dataclasses

    tr = trace(layers=4, experts=2)
    out = next(o for o in tr.operators if o.layer == "layers.2.feed_forward.experts").outputs[0]
    tr.tensors[out] = dataclasses.replace(tr.tensors[out], nbytes=2 * tr.tensors[out].nbytes)
    par = dict(pp=2, ep=2, accumulation_steps=2, schedule="interleaved", virtual_stages=2)
    sim, r = run(4, tr, batch=4, **par)
    ex, tl = sim.extrapolator, r.timeline
    assert [
        {o.layer.split(".")[1] for o in ops if o.layer.startswith("layers")}
        for ops in ex.pipe.fwd_ops
    ] == [{"0"}, {"1"}, {"2"}, {"3"}]
    sends = tl[tl.name.astype(str).str.startswith("send")]
    got = {
        (int(g), str(n), str(k), float(b))
        for g, n, k, b in zip(sends.gpu, sends.name, sends.key, sends.nbytes, strict=True)
        if g in (0, 2)
    }
    want = set()
    for m in range(2):
        want |= {
            (0, "send to 2", f"r0s0c0t0/act0.{m}", UNIT),
            (0, "send to 2", f"r0s0c0t0/act2.{m}", 2 * UNIT),
            (0, "send to 2", f"r0s0c0t0/grad2.{m}", UNIT),
            (2, "send to 0", f"r0s0c0t0/act1.{m}", UNIT),
            (2, "send to 0", f"r0s0c0t0/grad1.{m}", UNIT),
            (2, "send to 0", f"r0s0c0t0/grad3.{m}", 2 * UNIT),
        }
    assert got == want
    c0 = tl[(tl.gpu == 0) & (tl.kind == "compute") & (tl.phase != "optimizer")]
    steps = []
    for phase, mb, layer in zip(c0.phase, c0.microbatch, c0.layer, strict=True):
        step = (str(phase)[0].upper(), int(mb), int(str(layer).split(".")[1]))
        if not steps or steps[-1] != step:
            steps.append(step)
    assert steps == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2),
        ("B", 0, 2), ("B", 1, 2), ("B", 0, 0), ("B", 1, 0),
    ]  # fmt: skip
