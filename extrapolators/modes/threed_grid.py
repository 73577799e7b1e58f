"""3D parallelism's process grid: dp x pp x tp positions on the GPUs (x cp), and its groups.

`ThreeDGrid` is a part of `ThreeD` (its mixin). What it provides, once `_make_grid()` has
run: the degrees `dp`, `tp`, `pp`, `cp` and `v` (chunks per stage), checked against the GPU
count; `reps` = dp x cp replica slots, slot d = (data-parallel replica d // cp, CP rank
d % cp: the CP ranks of a replica run its pipeline on 1/cp of its tokens each); `grid`,
{(d, p, t): GPU} over the slots by `placement` (threed.py says how; CP just outside TP,
as Megatron-Core orders them), and `coord`, its inverse; `tp_group(d, p)`, `dp_group(p, t)`
(all dp x cp slots: CP ranks reduce gradients as replicas do) and `cp_group(d, p, t)`, the
members in the topology's ring order, one tuple per group built once (the runtime
compares a collective's group by identity first), and `pp_chain(d, t)`; and `symmetry()`,
replica 0 standing for the others (none with CP: ring neighbours differ per GPU).
What it needs: `options` (dp, tp, pp, cp, virtual_stages, placement), `gpus` and `ring`, as
`Extrapolator` has them; the group caches assume `ring` does not change after a group is
asked for.
"""

from __future__ import annotations

from extrapolators.execution.symmetry import Symmetry
from triosim.common.errors import ConfigError


class ThreeDGrid:
    """The grid of a 3D plan (module docstring: what it gives, what it needs)."""

    def _make_grid(self) -> None:
        """The degrees (checked: dp x tp x pp = num_gpus), `grid` and `coord`."""
        o, n = self.options, len(self.gpus)
        dp, tp, cp = o.dp, o.tp, o.cp
        if n % (dp * tp * cp):
            what = f"dp x tp ({dp} x {tp})" if cp == 1 else f"dp x tp x cp ({dp} x {tp} x {cp})"
            raise ConfigError("parallelism.dp", dp, f"{what} dividing num_gpus ({n})")
        pp = o.pp or n // (dp * tp * cp)
        if dp * tp * pp * cp != n:
            with_cp = f", cp = {cp}" if cp > 1 else ""
            raise ConfigError(
                "parallelism.pp",
                o.pp,
                f"dp x tp x pp{' x cp' if cp > 1 else ''} = num_gpus ({n}); dp = {dp}, "
                f"tp = {tp}{with_cp}",
            )
        self.dp, self.tp, self.pp, self.v, self.cp = dp, tp, pp, o.virtual_stages, cp
        self.reps = dp * cp  # replica slots: (data-parallel replica, CP rank) pairs
        if self.v > 1 and pp < 2:
            raise ConfigError(
                "parallelism.virtual_stages",
                self.v,
                "1 without pipeline stages (pp >= 2 to interleave)",
            )
        self.grid = self._place()
        self.coord = {g: (d, p, t) for (d, p, t), g in self.grid.items()}

    def _place(self) -> dict:
        o, dp, tp, pp, cp = self.options, self.dp, self.tp, self.pp, self.cp
        pl = o.placement
        grid = {}
        # slot D = d x cp + c: CP rank c of replica d, just outside TP (Megatron's order)
        if isinstance(pl, list):
            if sorted(map(str, pl)) != sorted(map(str, self.gpus)) or len(set(pl)) != len(pl):
                raise ConfigError(
                    "parallelism.placement",
                    pl,
                    f"a list of the {len(self.gpus)} GPU ids, each once",
                )
            by_name = {str(g): g for g in self.gpus}
            ids = [by_name[str(x)] for x in pl]
            for d in range(dp):
                for p in range(pp):
                    for c in range(cp):
                        for t in range(tp):
                            grid[d * cp + c, p, t] = ids[((d * pp + p) * cp + c) * tp + t]
        elif pl == "tp-pp-dp":
            for d in range(dp):
                for p in range(pp):
                    for c in range(cp):
                        for t in range(tp):
                            grid[d * cp + c, p, t] = self.gpus[((d * pp + p) * cp + c) * tp + t]
        elif pl == "dp-pp-tp":
            for d in range(dp):
                for p in range(pp):
                    for c in range(cp):
                        for t in range(tp):
                            grid[d * cp + c, p, t] = self.gpus[((t * cp + c) * pp + p) * dp + d]
        else:
            raise ConfigError(
                "parallelism.placement", pl, "tp-pp-dp, dp-pp-tp or a list of GPU ids"
            )
        return grid

    def _ring(self, members) -> tuple:
        """`members` in the topology's ring order (by their positions in it: O(group), not
        a pass over the whole ring per group)."""
        at = self.__dict__.get("_ring_at")
        if at is None:
            at = self._ring_at = {}
            for i, g in enumerate(self.ring):
                at.setdefault(g, i)
        if len(at) != len(self.ring):  # a GPU twice in the ring: the pass takes it twice
            s = set(members)
            return tuple(g for g in self.ring if g in s)
        return tuple(sorted({g for g in members if g in at}, key=at.__getitem__))

    def tp_group(self, d, p) -> tuple:
        """The tuple is built once per group: its members share it (and the runtime
        compares a collective's group by identity first)."""
        groups = self.__dict__.setdefault("_tp_groups", {})
        g = groups.get((d, p))
        if g is None:
            g = groups[d, p] = self._ring(self.grid[d, p, t] for t in range(self.tp))
        return g

    def dp_group(self, p, t) -> tuple:
        groups = self.__dict__.setdefault("_dp_groups", {})
        g = groups.get((p, t))
        if g is None:
            g = groups[p, t] = self._ring(self.grid[d, p, t] for d in range(self.reps))
        return g

    def cp_group(self, d, p, t) -> tuple:
        """The CP ranks of slot d's replica at (p, t): they share its sequences."""
        groups = self.__dict__.setdefault("_cp_groups", {})
        first = d - d % self.cp
        g = groups.get((first, p, t))
        if g is None:
            members = (self.grid[first + c, p, t] for c in range(self.cp))
            g = groups[first, p, t] = self._ring(members)
        return g

    def pp_chain(self, d, t) -> list:
        return [self.grid[d, p, t] for p in range(self.pp)]

    def symmetry(self) -> Symmetry | None:
        """The GPUs of data-parallel replica 0 represent the others, replica d mapped by grid
        position: its TP groups are `_ring` of the mapped members (as `tp_group`), its
        pipeline sends go between the mapped stages, and each DP group (one GPU per replica)
        is a whole class."""
        if self.cp > 1:
            return None  # (ring neighbours differ per GPU: every GPU is simulated)
        replicas = [
            [self.grid[d, p, t] for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
        ]
        coord, grid = self.coord, self.grid

        def image_group(group, k):
            return self._ring(grid[k, coord[g][1], coord[g][2]] for g in group)

        return Symmetry.of_replicas(replicas, image_group)
