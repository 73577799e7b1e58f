"""Gradient buckets of expert parallelism (mode `ep` with `dp_overlap`): the dense weights'
gradients and the experts' in separate buckets, since they are reduced over different
groups (all GPUs; an expert's replicas), each filled in the order the backward pass makes
them, as PyTorch DDP's (and Megatron-LM's distributed data parallel) buckets are.

`buckets(trace, expert_weights, ep, first, cap)` -> [(ready position, bytes, kind)] in the
order they are ready (kind "dense" or "expert"; expert bytes are one GPU's share, 1/ep):
each kind's weights sorted by the position of the operator after which their gradient
exists (extrapolators.modes.base.gradient_ready; ties: the later weight first, as DDP),
cut when a bucket reaches `first` bytes (the first of its kind) or `cap` (the others).
`param_buckets` gives the distributed optimizer's parameter all-gathers, overlapped with
the forward pass (Megatron's --overlap-param-gather: each bucket gathered before the
first forward operator that reads its weights).

`share_of(w)`, where given, is the share of weight w a GPU holds instead (with tensor and
expert-tensor parallelism: a TP-split dense weight's 1/tp, an expert's 1/(ep x etp));
`only`, where given, the weights to bucket (a pipeline stage's).
"""

from __future__ import annotations

from extrapolators.modes.base import gradient_ready


def buckets(
    trace, expert_weights: set, ep: int, first: float, cap: float, share_of=None, only=None
) -> list:
    ready = gradient_ready(trace)
    out = []
    for kind in ("dense", "expert"):
        share = 1.0 / ep if kind == "expert" else 1.0
        mine = [w for w in ready if (w in expert_weights) == (kind == "expert")]
        if only is not None:  # one pipeline stage's weights
            mine = [w for w in mine if w in only]
        size, last, made = 0.0, -1, 0
        for w in sorted(mine, key=lambda w: (ready[w], -w)):
            size += trace.tensors[w].nbytes * (share if share_of is None else share_of(w))
            last = max(last, ready[w])
            if size >= (first if not made else cap):
                out.append((last, size, kind))
                size, last, made = 0.0, -1, made + 1
        if size > 0:
            out.append((last, size, kind))
    return sorted(out, key=lambda b: b[0])


def param_buckets(trace, expert_weights: set, cap: float, share_of, only=None) -> list:
    """The distributed optimizer's parameter all-gathers with --overlap-param-gather:
    [(first use position, bytes, kind)] in the order the forward pass needs them (kind
    "dense" or "expert", each kind's weights in its own buckets since they are gathered
    over different groups; `share_of(w)`: the share of weight w a GPU holds). A weight's
    first use is the first forward operator that reads it; a bucket is cut at `cap`
    bytes, and is needed by its first weight's first use."""
    first: dict = {}
    for pos, op in enumerate(trace.operators):
        if op.phase == "forward":
            for t in op.inputs:
                first.setdefault(t, pos)
    out = []
    for kind in ("dense", "expert"):
        mine = [w.id for w in trace.weights() if (w.id in expert_weights) == (kind == "expert")]
        if only is not None:  # one pipeline stage's weights
            mine = [w for w in mine if w in only]
        mine.sort(key=lambda w: (first.get(w, len(trace.operators)), w))
        size, need = 0.0, None
        for w in mine:
            if need is None:
                need = first.get(w, len(trace.operators))
            size += trace.tensors[w].nbytes * share_of(w)
            if size >= cap:
                out.append((need, size, kind))
                size, need = 0.0, None
        if size > 0:
            out.append((need, size, kind))
    return sorted(out, key=lambda b: b[0])
