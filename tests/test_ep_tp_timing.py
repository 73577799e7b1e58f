"""How mode `ep` times the MoE layer's operators under tensor parallelism
(extrapolators/modes/expert_parallel.py), by hand on test_ep_tp's tiny layer made
memory-bound (the operators' FLOPs set to 1,000, so the roofline's time is its bytes over
the memory bandwidth, divided by the same per-name efficiency at any batch):

- the router (tp 2, sequence parallel) holds its whole weight and runs on the GPU's half
  of the sequence: T/2 tokens in and out plus the whole weight, not T tokens and half the
  weight (the TP-split target it was timed at before);
- a routed expert's grouped GEMM with expert-TP 2 runs on the tokens both GPUs of its
  expert-TP group received (Megatron all-gathers them after the dispatch) at half the FFN
  width: its hidden-wide input and output are 2 x the GPU's own tokens, its weight 1/4
  (ep 2 x etp 2) of the experts'.

The trace (test_ep_tp.trace): T = 4,096 tokens in 2 sequences, hidden H = 1,024 in
bfloat16 (TB = 2 KiB a token); every activation is one token-major (.., H) tensor.
"""

import dataclasses

import pytest

from perfmodel.base import Target
from tests.test_ep_tp import EXPERT, ROUTER, TB, B, L, T, trace
from triosim import Simulation
from triosim.trace.model import Trace


def memory_bound(tr, layer_end):
    ops = [
        dataclasses.replace(op, flops=1e3) if op.layer.endswith(layer_end) else op
        for op in tr.operators
    ]
    return Trace(ops, tr.tensors, tr.metadata).validate()


def op_time(r, gpu, name, layer_end):
    tl = r.timeline
    x = tl[(tl.gpu == gpu) & (tl.kind == "compute") & (tl.name == name)]
    x = x[x.layer.astype(str).str.endswith(layer_end)]
    return (x.end - x.start).tolist()


def traced_time(sim, name, layer_end):
    """The model's time of the operator at the traced batch (2 sequences, unsharded)."""
    op = next(o for o in sim.trace.operators if o.name == name and o.layer.endswith(layer_end))
    return sim.extrapolator.model.time(op, Target(batch_size=2))


def run(n, tr, **par):
    """test_ep_tp's setting, the roofline without its identity at the traced batch (so the
    traced batch's time is the roofline's too, and ratios of times are ratios of bytes)."""
    cfg = {
        "num_gpus": n,
        "batch_size": n,
        "parallelism": {"mode": "ep", **par},
        "topology": {"kind": "fully_connected", "bandwidth": B, "latency": L},
        "communication": {"kind": "textbook"},
        "perfmodel": {"kind": "roofline", "identity": False},
    }
    sim = Simulation(cfg, trace=tr)
    return sim, sim.run()


def test_the_router_runs_its_whole_weight_on_the_gpus_tokens():
    """tp 2, ep 2 on 4 GPUs, batch 4: a replica's micro-batch is the traced T tokens, each
    GPU's sequence-parallel share T/2. Router forward bytes: T/2 x TB in, T/2 x TB out,
    ROUTER weight; traced: T x TB in and out, the same weight."""
    tr = memory_bound(trace(), "router")
    sim, r = run(4, tr, tp=2, ep=2)
    want = traced_time(sim, "aten::linear", "router") * (T * TB + ROUTER) / (2 * T * TB + ROUTER)
    for g in range(4):
        assert op_time(r, g, "aten::linear", "router") == pytest.approx([want], rel=1e-9)


def test_an_expert_tp_gemm_reads_the_gathered_tokens():
    """tp 2, ep 2, etp 2 on 4 GPUs, batch 4, 2 experts top-1, uniform: each GPU's expert
    receives T/2 tokens (the precondition: scale 1), its expert-TP group T. The grouped
    GEMM's bytes: T x TB in (gathered), T x TB out (before the reduce-scatter), EXPERT / 4
    of weight; traced: T x TB in and out, EXPERT. Backward the same bytes (the gathered
    output gradient and input, the input gradient; the weight and its gradient / 4)."""
    tr = memory_bound(trace(), "experts")
    sim, r = run(4, tr, tp=2, ep=2, etp=2)
    assert sim.extrapolator.experts.scale == pytest.approx([1.0, 1.0])
    for name in ("aten::bmm", "aten::bmmBackward"):
        traced = 2 * T * TB + EXPERT + (EXPERT if name.endswith("Backward") else 0)
        here = 2 * T * TB + (EXPERT / 4) * (2 if name.endswith("Backward") else 1)
        want = traced_time(sim, name, "experts") * here / traced
        for g in range(4):
            assert op_time(r, g, name, "experts") == pytest.approx([want], rel=1e-9), name
