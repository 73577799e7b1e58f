"""One attention operator across a context-parallel group: the tasks each GPU runs.

Every GPU of a group of c holds 1/c of the sequence's tokens. Two ways to attend over the
whole sequence (Megatron-LM's `--cp-comm-type`, run by TransformerEngine's
`transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`):

`p2p`, ring attention (TE's AttnFuncWithCPAndKVP2P). The sequence is cut into 2c chunks and
GPU j holds chunks j and 2c-1-j, so that under a causal mask every GPU does the same work
(Megatron's load balancing). The attention runs in c steps: at step s a GPU attends its
queries to the key/value block of GPU j-s, and meanwhile passes that block on to GPU j+1
(one point-to-point send and receive per step, `flash_attn_p2p_communicate`); the last
step's block is not passed on, so forward sends c-1 blocks. With the two chunks every step
is half of a full block: the diagonal step is causal over 2 x 2 chunks, the others the
queries' two chunks against the block's first (earlier ranks) or the second query chunk
against both (later ranks). So each step is 1/c of the GPU's attention, which is 1/c of the
trace's attention at 1/c of its tokens: step time = the operator's time at the GPU's token
share / c. Backward goes the other way round (send to j-1, receive from j+1) with the
key/value block and the partial key/value gradient of the previous step in one message:
step 0 sends the block, steps 1..c-2 block and gradient, step c-1 the gradient only, which
reaches the block's owner after its last step (c messages; 2(c-1) blocks' bytes).
A send starts when both its GPUs have reached the step (TE posts each step's send and
receive together, `batch_isend_irecv`: NCCL's point-to-point pairs them), and a step's
compute waits for its block: that is the overlap of transfer and blockwise compute.
Not modelled: the per-step output and log-sum-exp corrections (element-wise, small).

`a2a`, DeepSpeed-Ulysses (Jacobs et al. 2023; TE's AttnFuncWithCPAndQKVOA2A). Before the
attention an all-to-all over the group turns each of q, k, v from (1/c of the tokens, all
heads) into (all tokens, 1/c of the heads); the attention runs whole on its heads (the
same FLOPs: the operator's time at the GPU's token share, once); an all-to-all turns the
output back. Backward: the output gradient's all-to-all, then those of dq, dk, dv. Each
all-to-all is one tensor, as TE issues them (`flash_attn_a2a_communicate`), and blocks the
compute stream. Grouped-query attention's keys and values go with their own heads.

Tensor bytes are per GPU: the trace's tensor times the GPU's token share of the trace
(`ratio`), keys and values at their key/value heads (the trace may hold them repeated).
"""

from __future__ import annotations

from extrapolators.execution.tasks import Collective, Recv, Send, Signal, Wait


def ring_compute(gpu, group, step, tag, forward: bool):
    """The compute stream's tasks of one ring attention on `gpu`: `step` is one step's
    Compute. Forward: receive from the previous GPU; backward: from the next (and the
    gradient of the GPU's own block after the last step)."""
    c = len(group)
    j = group.index(gpu)
    src = group[(j - 1) % c] if forward else group[(j + 1) % c]
    for s in range(c):
        if s:
            yield Recv(src, f"{tag}:{s}:{src}>{gpu}", step.layer, step.phase)
        if not forward or s < c - 1:
            yield Signal(f"{gpu}:{tag}:at{s}")  # both ends of step s's send must be here
        yield step
    if not forward:
        yield Recv(src, f"{tag}:{c}:{src}>{gpu}", step.layer, step.phase)


def ring_sends(gpu, group, kv_bytes, tag, forward: bool, layer="", phase=""):
    """The send stream's tasks of one ring attention on `gpu` (see the module docstring
    for what each message holds)."""
    c = len(group)
    j = group.index(gpu)
    dst = group[(j + 1) % c] if forward else group[(j - 1) % c]
    for s in range(c - 1 if forward else c):
        nbytes = kv_bytes if forward else kv_bytes * ((s < c - 1) + (s > 0))
        yield Wait(f"{gpu}:{tag}:at{s}", gpu)
        yield Wait(f"{dst}:{tag}:at{s}", dst)
        yield Send(dst, nbytes, f"{tag}:{s + 1}:{gpu}>{dst}", layer, phase)


def ulysses(group, task, before, after, tag, algorithm=None):
    """The compute stream's tasks of one Ulysses attention: an all-to-all of each size in
    `before` (bytes per GPU), the attention `task`, one of each size in `after`."""
    for k, nbytes in enumerate(before):
        yield _a2a(group, nbytes, f"{tag}:in{k}", task, algorithm)
    yield task
    for k, nbytes in enumerate(after):
        yield _a2a(group, nbytes, f"{tag}:out{k}", task, algorithm)


def _a2a(group, nbytes, key, task, algorithm):
    return Collective("all_to_all", group, nbytes, key, task.layer, task.phase, algorithm=algorithm)
