"""Each pipeline chunk's backward pass as the mesh runs it: with the forward operators that
recomputation runs again in it (blocks.with_recompute), or without for a micro-batch that
does not recompute. `ChunkWalks` (its contract in its docstring) is the part of `MeshMode`
(mode.py) that lays them out; template.py walks them.
"""

from __future__ import annotations

from extrapolators.modes.blocks import block_depth, check_modules, layer_units, with_recompute


class ChunkWalks:
    """The backward walks of a mesh's chunks, made at once from the `trace`, the mesh's
    options `o` (its `recompute`, `recompute_depth`, `recompute_every`,
    `recompute_microbatches` and `microbatches`) and the cut `pipe` (pipeline.StageCut:
    each chunk's `fwd_ops` and `bwd_ops`).
    What it gives:
      - `backward_walk[c]`: [(op, recomputed)] of chunk c's backward pass with its
        recomputed forward operators; `walk(c, m)`: the one micro-batch m runs (without
        them for each pipeline schedule's last micro-batch under `recompute_microbatches:
        except_last`);
      - `units_done(unit_of)`: (chunk, op id) -> the (chunk, unit) pairs whose last
        backward operator in the chunk that operator is, for FSDP's units (`unit_of`: op
        id -> unit, sharding.ShardPlan's).
    """

    def __init__(self, trace, o, pipe):
        self.o = o
        policy, unit_of, names = o.recompute, {}, None
        if policy == "stage":  # the chunk is one block
            policy = "full"
            unit_of = {op.id: 0 for op in trace.operators}
        elif policy != "none":
            depth = o.recompute_depth or block_depth(trace)
            unit_of, names, _ = layer_units(trace, depth)
            if policy == "modules":
                check_modules(trace.operators, o.recompute_modules)
        self.backward_walk, self._plain_walk = [], []
        for fwd, bwd in zip(pipe.fwd_ops, pipe.bwd_ops, strict=True):
            walk = with_recompute(
                fwd + bwd, policy, unit_of, names, o.recompute_every, o.recompute_modules
            )
            self.backward_walk.append(walk[len(fwd) :])
            self._plain_walk.append([(op, False) for op in bwd])

    def walk(self, c: int, m: int) -> list:
        """[(op, recomputed)] of chunk c's backward pass for micro-batch m."""
        o = self.o
        per = o.microbatches // o.accumulation  # a pipeline schedule's
        if o.recompute_microbatches == "except_last" and m % per == per - 1:
            return self._plain_walk[c]
        return self.backward_walk[c]

    def units_done(self, unit_of: dict) -> dict:
        """(chunk, op id) -> the (chunk, unit) pairs whose last backward operator in the
        chunk that operator is."""
        last: dict = {}
        for c, walk in enumerate(self.backward_walk):
            for op, again in walk:
                if not again and op.phase == "backward":
                    last[c, unit_of.get(op.id, 0)] = op.id
        done: dict = {}
        for (c, u), i in last.items():
            done.setdefault((c, i), []).append((c, u))
        return done
