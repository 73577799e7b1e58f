"""Zero-bubble pipelines: a backward split into its input-gradient part B and its
weight-gradient part W (extrapolators/modes/wgrad.py), and `schedule: zb1p` (Qi et al.
2024's ZB-1P as torch.distributed.pipelining's ScheduleInterleavedZeroBubble orders it).
Checked: the split on a Llama layer by hand, the order by hand, the iteration against the
paper's closed form and a schedule walked outside the simulator, the same work and bytes
as 1F1B, gradients reduced only after their W."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extrapolators.modes.schedules import schedule
from extrapolators.modes.wgrad import weight_grad_shares
from tests.conftest import chain_trace
from tests.test_dualpipev import check_steps, run, walked
from triosim import Simulation
from triosim.trace.files import load_any_trace

LLAMA = "traces/modelled/h100-sxm/llama3-8b-s8192-b1.trace.json.gz"


def test_a_llama_layers_weight_gradients_by_hand():
    """Llama 3 8B's first layer (8,192 tokens): every linear's backward product is half W
    (dW = dY^T X beside dX = dY W: equal FLOPs), the transpose and cast of its weight's
    gradient and autograd's AccumulateGrad all W; attention, norms and element-wise ops
    all B. Its W FLOPs: 2 x tokens x the layer's linear weights = 2 x 8,192 x (4,096 x
    (4,096 + 1,024 + 1,024 + 4,096) + 3 x 4,096 x 14,336 = 218,103,808) = 3.573e12."""
    t = load_any_trace(LLAMA)
    shares = weight_grad_shares(t)
    layer = [
        o for o in t.operators if o.phase == "backward" and (o.layer or "").startswith("layers.0.")
    ]
    kinds = {}
    for o in layer:
        kinds.setdefault(o.name.split(": ")[-1], set()).add(shares.get(o.id, 0.0))
    assert kinds["MmBackward0"] == {0.5}
    assert kinds["TBackward0"] == {1.0}
    assert kinds["torch::autograd::AccumulateGrad"] == {1.0}
    assert kinds["ToCopyBackward0"] >= {1.0}  # (the weights' casts; the norms' are B)
    for b in ("ScaledDotProductFlashAttentionForCpuBackward0", "SiluBackward0", "MulBackward0",
              "UnsafeViewBackward0", "ViewBackward0", "RsqrtBackward0"):  # fmt: skip
        assert kinds[b] == {0.0}, b
    w_flops = sum((o.flops or 0.0) * shares.get(o.id, 0.0) for o in layer)
    params = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    assert params == 218_103_808
    assert w_flops == pytest.approx(2 * 8192 * params, rel=1e-9)
    embedding = [o for o in t.operators if "EmbeddingBackward" in o.name]
    assert [shares[o.id] for o in embedding] == [1.0]


def test_zb1p_order_by_hand():
    """S = 2, M = 4, one chunk. Stage 0: S - s - 1 = 1 warm-up forward, then F B and, from
    the first (s = 0), the W of the oldest B; the last B with its W. Stage 1: no warm-up; its
    Ws start after its first s = 1 pair, the last ones at the end."""
    s0 = schedule("zb1p")(0, 2, 4, 1)
    assert " ".join(f"{k}{m}" for k, m, _ in s0) == "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"
    s1 = schedule("zb1p")(1, 2, 4, 1)
    assert " ".join(f"{k}{m}" for k, m, _ in s1) == "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 3))
def test_zb1p_runs_every_step(S, rounds, v):
    M = S * rounds
    for s in range(S):
        steps = schedule("zb1p")(s, S, M, v)
        check_steps(steps, M, v)
        assert sum(k == "W" for k, _, _ in steps) == M * v  # every backward split


@settings(max_examples=8, deadline=None)
@given(st.integers(2, 5), st.integers(1, 3))
def test_zb1p_takes_the_papers_time(S, rounds):
    """F = B = W (one product a layer: its backward is twice its forward, half of it W):
    ZB-H1's iteration is M (F + B + W) + (S - 1)(F + B - W) (Qi et al. 2024, section 3.2)
    = (3M + S - 1) f, against 1F1B's (M + S - 1)(F + B + W) = 3 (M + S - 1) f; and the
    walked schedule's."""
    M = S * rounds
    t = chain_trace(layers=S, t_opt=0, batch=M)
    f = 1e-3 / M
    zb = run(t, S, M, "zb1p", v=1).iteration_time
    assert zb == pytest.approx((3 * M + S - 1) * f, rel=1e-9)
    assert zb == pytest.approx(walked(S, M, f, 2 * f, name="zb1p", v=1), rel=1e-9)
    one = run(t, S, M, "1f1b", v=1).iteration_time
    assert one == pytest.approx(3 * (M + S - 1) * f, rel=1e-9)


def test_interleaved_zb1p_is_the_walked_schedule():
    t = chain_trace(layers=8, t_opt=0, batch=8)
    f = 1e-3 / 8
    got = run(t, 4, 8, "zb1p", v=2).iteration_time
    assert got == pytest.approx(walked(4, 8, f, 2 * f, name="zb1p", v=2), rel=1e-9)


def mesh(schedule_name, **par):
    cfg = {
        "num_gpus": 8,
        "batch_size": 32,
        "parallelism": {"mode": "mesh", "pp": 2, "microbatches": 4,
                        "schedule": schedule_name, **par},
        "topology": {"kind": "fully_connected", "bandwidth": 1e9, "latency": 1e-6},
        "communication": {"kind": "textbook"},
    }  # fmt: skip
    return Simulation(cfg, trace=chain_trace(layers=4, t_opt=0, batch=8)).run()


@pytest.mark.parametrize("dp", [{"dp_replicate": 4}, {"dp_shard": 4}, {"dp_shard": 2, "tp": 2}])
def test_the_same_work_and_bytes_as_1f1b(dp):
    """DDP, FSDP, FSDP x TP over a 2-stage pipeline: zb1p runs the same compute (each GPU's
    total compute time) and moves the same bytes as 1F1B; only the order moves."""
    zb, one = mesh("zb1p", **dp), mesh("1f1b", **dp)

    def work(r):
        c = r.timeline[r.timeline["kind"] == "compute"]
        return (c["end"] - c["start"]).groupby(c["gpu"]).sum()

    assert work(zb).to_numpy() == pytest.approx(work(one).to_numpy(), rel=1e-9)
    assert zb.collective_bytes == pytest.approx(one.collective_bytes, rel=1e-12)


@pytest.mark.parametrize("dp", [{"dp_replicate": 4}, {"dp_shard": 4}])
def test_gradients_reduce_after_their_weight_gradients(dp):
    """Each GPU's gradient reduction (DDP's bucket all-reduce, FSDP's reduce-scatter)
    starts only after the first W operator of the last micro-batch (two layers a stage:
    its B's two operators, then its W's two; the first W completes the later layer's
    weight gradient), where on 1F1B it starts after the backward's first operator."""
    for name, after in (("zb1p", 2), ("1f1b", 0)):
        tl = mesh(name, **dp).timeline
        for g in range(8):
            mine = tl[tl["gpu"] == g]
            reduce = mine[mine["name"].str.contains("reduce")]
            last = mine[(mine["kind"] == "compute") & (mine["microbatch"] == 3)]
            last = last[last["phase"] == "backward"].sort_values("start")
            assert len(reduce) and len(last) == (4 if name == "zb1p" else 2)
            assert reduce["start"].min() == pytest.approx(last["end"].iloc[after], abs=1e-12)


@pytest.mark.parametrize("host", ["on", "off"])
def test_a_split_operator_launches_its_kernels_once(host):
    """A real GPT-2 trace with the host model on (each kernel's launch gap and the host's
    issue time): zb1p's B and W parts of an operator share its kernels, so each GPU
    computes as long as on 1F1B (a fresh-eyes review found them counted twice: 256
    kernels x 4 micro-batches x 1.07 us more)."""
    t = load_any_trace("traces/h100/gpt2-s512-b8.trace.json.gz")

    def work(name):
        cfg = {
            "num_gpus": 2, "batch_size": 8, "host": {"model": host},
            "overlap": {"compute_slowdown": 0},
            "parallelism": {"mode": "mesh", "pp": 2, "microbatches": 4, "schedule": name},
            "topology": {"kind": "fully_connected", "bandwidth": 1e11, "latency": 1e-6},
        }  # fmt: skip
        tl = Simulation(cfg, trace=t).run().timeline
        c = tl[tl["kind"] == "compute"]
        return (c["end"] - c["start"]).groupby(c["gpu"]).sum().to_numpy()

    assert work("zb1p") == pytest.approx(work("1f1b"), rel=1e-9)


def test_a_convolutions_filter_gradient_is_w():
    """ResNet-50: each convolution's backward is half W (its filter's gradient beside its
    input's, equal FLOPs)."""
    t = load_any_trace("traces/modelled/h100-sxm/resnet50-b128.trace.json.gz")
    shares = weight_grad_shares(t)
    conv = [o for o in t.operators if o.name.endswith("ConvolutionBackward0")]
    assert len(conv) == 53 and {shares.get(o.id) for o in conv} == {0.5}
