"""Tensor parallelism's roles: how each operator of the trace is split (see tensor_parallel.py
for what each style does with them). `TPRoles` (its contract in its docstring) is the part of
the plan `TensorParallel` holds that finds them.
"""

from __future__ import annotations

import heapq
import math

LOSS_NAMES = ("cross_entropy", "nll_loss")
SPLIT = frozenset({"column", "row", "vocab", "head", "gather", "channel"})  # sharded weights
SHARDED = frozenset({"sharded", "loss", "sequence"})  # unsplit operators on 1/N of the data


def weight_roots(trace, fwd) -> dict[int, int]:
    """Weight-like tensors -> the parameter each comes from (`TPRoles.roots` says which):
    every weight, and what a forward operator of `fwd` makes from one weight-like tensor
    and nothing that grows with the batch, at its size."""
    T = trace.tensors
    got = {t: t for t, x in T.items() if x.category == "weight"}
    for op in fwd:
        src = {t for t in op.inputs if t in got}
        if len(src) != 1 or any(T[t].scales_with_batch for t in op.inputs if t not in got):
            continue
        (w,) = src
        for t in op.outputs:
            if t not in got and math.prod(T[t].shape) == math.prod(T[w].shape):
                got[t] = got[w]
    return got


def reads_weight(op, roots) -> bool:
    """A layer: a splittable operator reading a weight-like tensor (one of `roots`)."""
    return op.tp_split and any(t in roots for t in op.inputs)


class TPRoles:
    """The roles of a tensor-parallel plan: how each operator is split.

    Made from the `trace`, the plan's `options` (its `tp_style` and `sequence_parallel`),
    the forward operators `fwd`, and what the plan leaves out (an MoE model's, moe_tp.py):
    `left_out`, operators that are not layers and get no orphan collective, and `routed`,
    operators (both phases) that get no role. Usable at once:
      - `roots`: weight-like tensors -> the parameter each comes from: every weight, and
        what a forward operator makes from one weight-like tensor and nothing that grows
        with the batch, at its size: the bfloat16 cast of a float32 parameter where it is
        used (torchtitan's mixed precision), a view, a transpose, a copy. A layer that
        reads one reads its parameter, so it is split as the parameter's layer would be;
      - `is_layer(op)`: a splittable operator reading one of them (and not left out);
        `weights(op)`: the ones it reads.
    What `plan()` gives (once; until then `roles` is empty):
      - `roles`: op id -> role, for every operator that is split or runs on part of the
        data: the layers' "column", "row", "vocab", "head", "gather" or "channel" (SPLIT:
        they hold a shard of their weights), "replicated" (an embedding every GPU holds
        whole), and "sharded", "loss" or "sequence" (SHARDED: unsplit operators on 1/N of
        the data); a backward operator has its forward operator's role;
      - `bwd_of`: a layer's op id -> its backward operators, in trace order; `orphans` (and
        their ids, `orphan_ids`): split backward operators no layer claims;
      - `loss_op`, `head_op` (Megatron's style only): its vocabulary-parallel loss and the
        head that feeds it, or None;
      - `split_weight_like()`: the weight-like tensors the split layers shard.
    It knows nothing of the GPUs, the degree or the batch: tp_collectives.TPCollectives
    reads the roles to size the collectives, and TensorParallel says at which size each
    operator runs.
    """

    def __init__(self, trace, options, fwd, left_out=frozenset(), routed=frozenset()):
        self.trace, self.options, self.fwd = trace, options, fwd
        self.left_out, self.routed = left_out, routed
        self.roots: dict[int, int] = weight_roots(trace, fwd)
        self.roles: dict[int, str] = {}
        self.loss_op = self.head_op = None

    def plan(self) -> None:
        """`roles`, `bwd_of`, `orphans`, `loss_op` and `head_op` for the forward operators
        (and the backward operators paired with them)."""
        fwd = self.fwd
        if self.options.tp_style == "channel":
            for op in fwd:
                if self.is_layer(op):
                    self.roles[op.id] = "channel"
        else:
            self._megatron_roles(fwd)
        self._copies(fwd)
        self._backward_pairs(fwd)
        for i in self.routed:  # mode ep times and places them (both phases)
            self.roles.pop(i, None)
        self.orphans = [o for o in self.orphans if o.id not in self.left_out]
        self.orphan_ids -= self.left_out

    def is_layer(self, op) -> bool:
        return op.id not in self.left_out and reads_weight(op, self.roots)

    def weights(self, op) -> list[int]:
        """The weight-like tensors a layer reads (a parameter, or its cast where used)."""
        return [t for t in op.inputs if t in self.roots]

    def _copies(self, fwd) -> None:
        """Forward operators that only copy a split parameter (its cast where used) copy
        each GPU's shard: they run on 1/N, and so does their backward."""
        roots, split = self.roots, {self.roots[t] for t in self.split_weight_like()}
        for op in fwd:
            if (
                op.id not in self.roles
                and op.outputs
                and all(roots.get(t, -1) in split for t in op.outputs)
            ):
                self.roles[op.id] = "sharded"

    def _megatron_roles(self, fwd):
        T, roles = self.trace.tensors, self.roles
        readers: dict[int, list[int]] = {}
        for k, op in enumerate(fwd):
            for t in set(op.inputs):
                readers.setdefault(t, []).append(k)
        layer = [self.is_layer(op) for op in fwd]
        users: dict[int, int] = {}  # parameter -> layers that read it (or its cast)
        for k, op in enumerate(fwd):
            if layer[k]:
                for w in {self.roots[t] for t in self.weights(op)}:
                    users[w] = users.get(w, 0) + 1
        embeddings = set()
        for k, op in enumerate(fwd):
            if layer[k] and "embedding" in op.name:
                embeddings.add(k)
                indexed_by_input = any(T[t].category == "input" for t in op.inputs)
                tied = any(users[self.roots[w]] > 1 for w in self.weights(op))
                roles[op.id] = "vocab" if indexed_by_input or tied else "replicated"
        self.loss_op = self.head_op = None
        for k, op in enumerate(fwd):
            if not layer[k] or k in embeddings or op.id in roles:
                continue
            between, end, kind, reached = self._reach(fwd, k, readers, layer)
            inside = set(between) | ({end} if end is not None else set())
            closed = end is not None and all(
                r in inside for t in reached for r in readers.get(t, ())
            )
            if closed and kind == "layer" and end not in embeddings:
                roles[op.id], roles[fwd[end].id] = "column", "row"
                for i in between:
                    roles[fwd[i].id] = "sharded"
            elif closed and kind == "loss":
                roles[op.id] = "head"
                for i in [*between, end]:
                    roles[fwd[i].id] = "loss"
                self.loss_op, self.head_op = fwd[end], op
            else:
                roles[op.id] = "gather"
        if self.options.sequence_parallel:
            ks = [k for k, op in enumerate(fwd) if roles.get(op.id) in ("vocab", "row")]
            last = next((k for k, op in enumerate(fwd) if roles.get(op.id) == "head"), len(fwd))
            for k in range(min(ks, default=len(fwd)) + 1, last):
                op = fwd[k]
                # an operator on the tokens (not a weight's bfloat16 cast, which is no
                # activation: each GPU casts the parameter it holds, `_copies`)
                tokens = any(T[t].scales_with_batch for t in (*op.inputs, *op.outputs))
                if op.id not in roles and not layer[k] and "embedding" not in op.name and tokens:
                    roles[op.id] = "sequence"

    def _reach(self, fwd, k, readers, layer):
        """Follow layer fwd[k]'s outputs forward through operators that are not layers, in
        trace order, up to the first layer or loss operator that reads them. Returns (the
        operators passed, that operator's position or None, 'layer' | 'loss' | None, the
        tensors reached)."""
        T = self.trace.tensors
        keep = ("weight", "gradient", "optimizer_state")
        reached = {t for t in fwd[k].outputs if T[t].category not in keep}
        heap = sorted({r for t in reached for r in readers.get(t, ()) if r > k})
        seen, between = set(heap), []
        while heap:
            j = heapq.heappop(heap)
            op = fwd[j]
            if layer[j]:
                return between, j, "layer", reached
            if any(s in op.name for s in LOSS_NAMES):
                return between, j, "loss", reached
            between.append(j)
            for t in op.outputs:
                reached.add(t)
                for r in readers.get(t, ()):
                    if r > j and r not in seen:
                        seen.add(r)
                        heapq.heappush(heap, r)
        return between, None, None, reached

    def _backward_pairs(self, fwd):
        """Group backward operators by the layer they differentiate and give every backward
        operator its forward operator's role."""
        trace, roles = self.trace, self.roles
        layer_ids = {op.id for op in fwd if self.is_layer(op)}
        owners: dict[int, set] = {}  # a weight-like tensor (and its parameter) -> layers
        for op in fwd:
            if op.id in layer_ids:
                for w in self.weights(op):
                    owners.setdefault(w, set()).add(op.id)
                    owners.setdefault(self.roots[w], set()).add(op.id)
        self.bwd_of: dict[int, list] = {}
        self.orphans = []  # split backward operators no layer claims
        self.orphan_ids = set()
        first_layer_bwd = None
        for op in trace.operators:
            if op.phase != "backward":
                continue
            f = op.fwd_id
            if f is None and op.tp_split:
                mine = set().union(*(owners.get(t, set()) for t in op.inputs))
                f = mine.pop() if len(mine) == 1 else None
            if f is not None and f in roles:
                roles[op.id] = roles[f]
            if f in layer_ids:
                self.bwd_of.setdefault(f, []).append(op)
                if first_layer_bwd is None:
                    first_layer_bwd = op
            elif op.tp_split:
                self.orphans.append(op)
                self.orphan_ids.add(op.id)
            if self.options.tp_style == "channel" and first_layer_bwd is not None:
                # after the first layer's backward every gradient is a channel shard
                if roles.get(op.id) != "channel":
                    roles[op.id] = "sharded"

    def split_weight_like(self) -> set[int]:
        """The weight-like tensors split layers read and shard (a row layer's bias whole)."""
        T, out = self.trace.tensors, set()
        for op in self.fwd:
            role = self.roles.get(op.id)
            if role == "row":
                out.update(w for w in self.weights(op) if len(T[w].shape) >= 2)
            elif role in SPLIT:
                out.update(self.weights(op))
        return out
