"""`memory.activations: fused` (triosim/results/fused_saves.py): what a Llama layer keeps for
its backward when fused kernels run it (TransformerEngine, Megatron-Core), from the eager
shape-only trace, by hand."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from triosim.results.memory import activation_plan
from triosim.simulation.wiring import Simulation
from triosim.trace.model import load

LLAMA = (
    Path(__file__).resolve().parents[1]
    / "traces/modelled/h100-sxm/llama3-8b-s8192-b1.trace.json.gz"
)
S, H = 8192, 4096  # tokens and hidden size of the trace (Llama 3 8B, one sequence of 8192)


class _One:
    def activation_ratio(self, op) -> float:
        return 1.0


def saved_by_layer(trace, fused: bool, layer: str) -> float:
    """Bytes of the allocations a forward operator of `layer` (or its modules) makes first
    and a backward operator reads last: what the layer keeps for its backward."""
    first, last, size = {}, {}, {}
    plan = activation_plan(trace, _One(), fused)
    for o in trace.operators:
        items = plan.get(o.id)
        if not items:
            continue
        for k, nbytes, *_ in items[0]:
            first.setdefault(k, o)
            last[k], size[k] = o, nbytes
    return sum(
        size[k]
        for k, o in first.items()
        if o.phase == "forward"
        and last[k].phase == "backward"
        and (o.layer == layer or o.layer.startswith(layer + "."))
    )


@pytest.fixture(scope="module")
def llama():
    return load(LLAMA)


def test_a_fused_llama_layer_keeps_what_transformer_engine_keeps(llama):
    # bfloat16, per token, in units of h bytes: the layer's input and
    # the attention block's residual output (2 each: the norms' inputs), the norms' outputs
    # (2 each: the projections' inputs), q after RoPE (2), k after RoPE and v (0.5 each:
    # 8 of 32 heads), the attention output (2: also the output projection's input), the
    # gate and up projections' outputs (7 each: 14336 = 3.5 h wide) and SwiGLU's output (7,
    # the down projection's input): 34, as TransformerEngine's modules keep. Here 2.5 more:
    # RoPE's backward reads the rotated q and k's inputs (2 + 0.5), where TE's fused RoPE
    # keeps only its frequencies.
    want = (2 + 2) + (2 + 2) + 2 + 0.5 + 0.5 + 2 + (7 + 7 + 7) + (2 + 0.5)
    got = saved_by_layer(llama, True, "layers.0") / (S * H)
    assert got == pytest.approx(want, abs=1e-9)
    # the eager trace keeps more: SwiGLU's activation output (7), the key/value heads
    # repeated for the attention (2 x 1.5 more), norms' and RoPE's float32 copies, ...
    assert saved_by_layer(llama, False, "layers.0") / (S * H) > want


def test_fused_saves_less_and_changes_no_time(llama):
    runs = {}
    for a in ("trace", "fused"):
        cfg = {"num_gpus": 1, "perfmodel": {"kind": "trace"}, "memory": {"activations": a}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[a] = Simulation(cfg, trace=llama).run()
    t, f = runs["trace"], runs["fused"]
    assert f.iteration_time == t.iteration_time  # memory only
    assert max(f.peak_memory.values()) < max(t.peak_memory.values())
    # 32 layers x at least the 34 h per token above fit under the fused peak; at most the
    # 36.5 h of each layer and the loss's float32 vocabulary-sized tensors (four at most:
    # logits, log-softmax, their gradients; 128,256 words) are held at it
    m = f.memory
    act = m.loc[m.total.idxmax()].activations
    assert 32 * 34 * S * H < act <= 32 * 36.5 * S * H + 4 * S * 128256 * 4


def test_an_activation_whose_backward_reads_its_output_is_not_kept_twice():
    # DenseNet-121 (real H100 trace): its ReLUs are not in place; ReluBackward reads the
    # ReLU's output, which the next convolution keeps anyway. Reading the ReLU's input
    # instead (the batch norm's output) kept both: the peak rose 17 %. Fused kernels keep
    # no more than the trace does here
    t = load(Path(__file__).resolve().parents[1] / "traces/h100/densenet121-b64.trace.json.gz")
    peaks = {}
    for a in ("trace", "fused"):
        cfg = {"num_gpus": 1, "perfmodel": {"kind": "trace"}, "memory": {"activations": a}}
        peaks[a] = max(Simulation(cfg, trace=t).run().peak_memory.values())
    assert peaks["fused"] <= peaks["trace"]


def test_real_copies_are_kept_and_data_movement_is_not():
    from triosim.results.fused_saves import role
    from triosim.trace.model import Operator

    def op(name):
        return Operator(0, name, "l", "forward", 0.0, (), ())

    moves = ("aten::view", "aten::expand", "aten::reshape", "aten::contiguous", "aten::clone")
    assert {role(op(n)) for n in moves} == {"move"}
    # MoE's token permutation, a concatenation, new tensors: real copies, kept
    copies = ("aten::index_select", "aten::gather", "aten::cat", "aten::zeros_like", "aten::full")
    assert {role(op(n)) for n in copies} == {None}
    chains = ("aten::to", "aten::mul", "aten::silu", "aten::rms_norm", "aten::add")
    assert {role(op(n)) for n in chains} == {"chain"}
    assert (
        role(op("aten::linear")) is None and role(op("aten::scaled_dot_product_attention")) is None
    )
