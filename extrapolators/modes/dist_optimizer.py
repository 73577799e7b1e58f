"""Megatron-LM's distributed optimizer (`--use-distributed-optimizer`, megatron/core/
optimizer/distrib_optimizer.py; docs/source/api-guide/dist_optimizer.md): the parts every
mode that offers it shares (mode cp through cp_tp.py, mode 3d through threed_streams.py).

Over a data-parallel group of d GPUs holding the same parameters (with CP: the dp x cp
GPUs of a TP shard; in 3D: of one pipeline stage's TP shard), Megatron
  - reduce-scatters each gradient bucket instead of all-reducing it (`grad_reduction`);
  - steps the optimizer on each GPU's 1/d of the parameters (the mode scales the
    optimizer's time by 1/d);
  - all-gathers the updated parameters after the step (`param_gather`: without
    --overlap-param-gather, before the next forward);
  - keeps the parameters and its contiguous gradient buffer whole (each parameter's
    main_grad is a view of it: the buffer is the mode's `buffer_bytes`, so no gradient
    tensor comes and goes beside it) and 1/d of the optimizer states (`state_fractions`):
    with float32 parameters and AdamW 4 + 4 + 8/d bytes per parameter, the
    "fp32 param, fp32 grads: 8 + 8/d" row of dist_optimizer.md.
"""

from __future__ import annotations

from extrapolators.execution.tasks import Collective


def grad_reduction(distributed: bool) -> str:
    """The collective a gradient bucket is reduced with."""
    return "reduce_scatter" if distributed else "allreduce"


def param_gather(group, nbytes: float, key: str, algorithm=None) -> Collective | None:
    """The all-gather of the updated parameters (`nbytes`: those the GPU holds, whole) over
    the data-parallel `group` after the step; None where the group is one GPU."""
    if len(group) < 2 or nbytes <= 0:
        return None
    return Collective(
        "all_gather", group, nbytes, key, layer="parameters", phase="optimizer", algorithm=algorithm
    )


def state_fractions(held: float, parts: int) -> dict:
    """Shares of the trace's weights a GPU keeps as weights, gradient tensors and optimizer
    states: `held` (the weights it holds, as a fraction of all) whole, no gradient tensor
    (the gradient buffer holds them), optimizer states 1/`parts` of the held."""
    return {"weights": held, "gradients": 0.0, "optimizer_states": held / parts}
