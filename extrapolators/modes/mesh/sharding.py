"""FSDP2 over a mesh (`dp_shard` > 1, `zero: 3`): the units a model is sharded in, their
bytes per pipeline chunk, and which units reshard after their forward pass.

As torchtitan applies FSDP2 (torchtitan/models/llama3/infra/parallelize.py, `apply_fsdp`,
over the flattened "dp_shard_cp" mesh: the weights are replicated over CP as over DP, so
they are sharded over both): `fully_shard` per block, here a unit of consecutive forward
operators whose layer names share `wrap_depth` dotted parts (blocks.layer_units). A GPU
holds 1/(dp_shard x cp) of each unit's weights (of its TP shard; of the routed experts' its
EP shard, 1/edp: they are sharded over their replicas, mesh/experts.py); before a unit's forward
the unit is all-gathered over the GPU's shard group, one unit ahead of the compute (FSDP2's
prefetch), and again before its backward where it resharded after the forward; after the
last micro-batch's backward of a unit its gradients are reduce-scattered over the group
(and, with dp_replicate > 1, HSDP, the reduced shard all-reduced over the replicas). A
pipeline cut inside a unit gives each chunk its own part of it: (chunk, unit) pairs.

`reshard_after_forward` (torchtitan's fsdp_reshard_after_forward): "default" reshards every
unit but the last one holding weights (torchtitan keeps the last block and the final norm
and output gathered, since FSDP would gather them right back for the backward pass), and
none with pipeline stages (torchtitan: "to avoid per-microbatch all-gathers"); "always"
every unit; "never" none. After a backward pass a unit reshards, except with pipeline
stages before its last micro-batch (torch.distributed.pipelining turns resharding after
backward and gradient sync off for the others).
"""

from __future__ import annotations

from extrapolators.modes.blocks import block_depth, layer_units


class ShardPlan:
    """The units (module docstring): `unit_of` (op id -> unit), `names`, `bytes[(c, u)]` (a
    GPU's TP shard of unit u's weights first read in chunk c, before sharding, as gathered:
    in the precision's `params`), `grads[(c, u)]` (their gradients as reduced), and
    `reshards(u)`."""

    def __init__(self, trace, wrap_depth, weights, policy: str, pp: int):
        # default: one unit per numbered block (torchtitan's fully_shard per transformer
        # block), else blocks.layer_units' rule
        depth = wrap_depth or block_depth(trace)
        self.unit_of, self.names, held = layer_units(trace, depth)
        chunk_of = {w: c for c, ws in enumerate(weights.chunk_weights) for w in ws}
        self.bytes: dict = {}
        self.expert_bytes: dict = {}  # the routed experts' (sharded over their replicas)
        self.grads: dict = {}
        self.expert_grads: dict = {}
        for u, ws in enumerate(held):
            for w in ws:
                c = chunk_of.get(w)
                if c is not None:
                    ex = w in weights.experts
                    d = self.expert_bytes if ex else self.bytes
                    d[c, u] = d.get((c, u), 0.0) + weights.gbytes[w]
                    d = self.expert_grads if ex else self.grads
                    d[c, u] = d.get((c, u), 0.0) + weights.rbytes[w]
        weighted = [u for u, ws in enumerate(held) if any(w in chunk_of for w in ws)]
        if policy == "always":
            self._keep = set()
        elif policy == "never" or (policy == "default" and pp > 1):
            self._keep = set(range(len(held)))
        else:
            self._keep = {weighted[-1]} if weighted else set()
        self.units = len(held)

    def of(self, kind: str, grads: bool = False) -> dict:
        """(chunk, unit) -> bytes of `kind` ("dense" or "expert") as gathered, or their
        gradients' as reduced."""
        if grads:
            return self.grads if kind == "dense" else self.expert_grads
        return self.bytes if kind == "dense" else self.expert_bytes

    def reshards(self, u: int) -> bool:
        """Whether unit u frees its gathered parameters after its forward pass."""
        return u not in self._keep

    def buffer(self, chunks, share: float, expert_share: float = 1.0) -> float:
        """The gathered parameters a stage's GPU keeps beside its shards: the two largest
        units (the current and the prefetched one), or all of them where none reshards
        (pipeline stages by default), less the GPU's own shards (`share` of the dense
        weights, `expert_share` of the experts')."""
        every = len(self._keep) == self.units
        if not self.expert_bytes:
            mine = sorted((b for (c, _), b in self.bytes.items() if c in chunks), reverse=True)
            return sum(mine if every else mine[:2]) * (1 - share)
        keys = {k for k in (*self.bytes, *self.expert_bytes) if k[0] in chunks}
        mine = sorted(
            (
                self.bytes.get(k, 0.0) * (1 - share)
                + self.expert_bytes.get(k, 0.0) * (1 - expert_share)
                for k in keys
            ),
            reverse=True,
        )
        return sum(mine if every else mine[:2])
