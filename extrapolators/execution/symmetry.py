"""Symmetry: simulate one representative per class of identical GPUs (config `symmetry: auto`).

A mode may declare its symmetry (`Extrapolator.symmetry()`): the representative GPUs R and K
copies of them, `orbits[r] = (r, s_1(r), ..., s_{K-1}(r))`, such that the task streams of
GPU s_k(g) are g's with every GPU mapped by s_k (keys aside: they only pair tasks up). DDP
has one representative (every GPU runs the same stream, the one collective spans all);
3D parallelism has the GPUs of data-parallel replica 0, replicas mapped by grid position.

The runtime then runs only R's streams:
- a collective whose group G lies within R also runs over every image s_k(G), at the same
  instant and through the same network (every byte still moves: replicas contend as they
  do in the full run); the representatives resume when G's ends;
- a collective whose group is a union of whole classes (the data-parallel all-reduce at
  one grid position, DDP's all-reduce over every GPU) is met by its representatives and
  runs once, over the whole group, as in the full run;
- with copies along several axes (`axes`: copy k is a point of Z_n1 x ... x Z_nm, the
  last axis fastest; copy k of copy h is their sum, axis by axis), a collective whose group
  is some representatives at every copy of whole axes (a TP group when TP is an axis: one
  representative at its TP copies) is met by those representatives and runs over the group
  and over its image in one copy of every other coset (the full run's other such groups);
- a send between representatives also sends every image s_k(a) -> s_k(b); a send from a
  to an image s_j(b) too, each copy's s_k(a) -> s_k(s_j(b)), and its end is b's receive
  from s_{-j}(a) (that transfer's image; the n-th of a pair with the n-th); a wait on an
  image's signal waits on its representative's (`Wait.gpu`);
- anything else (a group or a send that mixes classes otherwise) breaks the symmetry.

Why this is the full run: compute is identical within a class (same tasks, same compute
factor: checked), so by induction over the events every GPU of a class reaches each task
at its representative's instant, provided every image operation ends at the instant its
representative's does. The runtime checks exactly that (`Twins`) and the run is abandoned
(`SymmetryBroken`) at the first image that ends elsewhere, e.g. behind a slower link; the
simulation then falls back to the full run and says why.
"""

from __future__ import annotations

import itertools

import numpy as np

from extrapolators.execution.tasks import (
    Collective,
    Compute,
    ComputeRun,
    Iteration,
    Recv,
    Send,
    Signal,
    Wait,
    WaitSome,
)
from triosim.common.errors import SimulationError

# Two instants are the same when they differ by at most this, relative. The packet network
# calls a flow done when what is left would take less than 1e-12 x now at its rate (the
# clock's resolution): completions closer than that are one instant to it, and the order in
# which same-instant transfers are started (which a symmetric run cannot reproduce bit for
# bit) moves completions by that much (shown by the network's differential fuzzer). A
# larger difference is a real asymmetry (a slower link, a contended replica).
SAME_INSTANT = 1e-12

SAMPLED_COPIES = 16  # copies whose streams `check_streams` compares (all when K <= 17)


class SymmetryBroken(SimulationError):
    """The declared symmetry does not hold for this run (the message says where)."""

    def __init__(self, message: str, hint: str = ""):
        self.message, self.hint = message, hint  # what broke; the likely causes
        super().__init__(message, hint)  # (SimPy rebuilds a failed process's error from args)

    def __str__(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


class SymmetryWarning(UserWarning):
    """`symmetry: auto` fell back to the full simulation."""


def same_instant(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= SAME_INSTANT * max(abs(a), abs(b))


class Symmetry:
    """Classes of identical GPUs: `orbits[r]` is representative r and its K - 1 images, in
    copy order (copy 0 is the representative itself). `image_group(group, k)` is the
    group tuple copy k uses where the representatives use `group` (a group inside R);
    the default maps member by member, in order."""

    # copies whose streams `check_streams` compares: a mode whose copies' streams come from
    # one shared plan (the mesh's stage templates) may sample fewer
    sample = SAMPLED_COPIES

    # a coarser declaration the run tries where this one breaks (the mesh: copies along one
    # axis where several broke), before the full run
    fallback = None

    def __init__(self, orbits: dict, image_group=None, axes=None):
        self.orbits = {r: tuple(o) for r, o in orbits.items()}
        self.reps = tuple(self.orbits)
        self.copies = len(next(iter(self.orbits.values()))) if self.orbits else 0
        self.axes = tuple(axes) if axes else (self.copies,)
        self._image_group = image_group
        self._plans: dict = {}  # id(group) -> (group, members in R, image groups, their copies)
        self._where: dict | None = None  # GPU -> (its representative, its copy)
        self._image_groups: dict = {}  # (id(group), k) -> (group, its image in copy k)
        self._table = None  # `images`' arrays, made when first asked
        # the representatives' collectives and sends (check_streams keeps them), which a
        # run by orbits prepares before it starts
        self.collectives: list = []
        self.sends: list = []
        self._seen: set = set()

    @classmethod
    def of_replicas(cls, replicas, image_group=None, axes=None) -> Symmetry:
        """K position-aligned lists of GPUs: replica 0's are the representatives."""
        first = list(replicas[0])
        orbits = {g: tuple(rep[i] for rep in replicas) for i, g in enumerate(first)}
        return cls(orbits, image_group, axes)

    @classmethod
    def one_class(cls, gpus) -> Symmetry:
        """Every GPU identical: the first represents them all."""
        gpus = list(gpus)
        return cls({gpus[0]: tuple(gpus)}) if gpus else cls({})

    def describe(self, n: int) -> str:
        r = len(self.reps)
        return f"auto: {r} representative{'s' if r != 1 else ''} of {n} GPUs"

    # -- checks before the run ---------------------------------------------------------------
    def problem(self, gpus) -> str | None:
        """Why this declaration cannot stand for `gpus`, or None: the orbits must have one
        length K >= 2, start with their representative and partition the GPUs."""
        if not self.orbits:
            return "the mode declared no representatives"
        if self.copies < 2:
            return "every GPU is its own class (no identical replicas to share a simulation)"
        if int(np.prod(self.axes)) != self.copies:
            return f"the copies' axes {self.axes} do not multiply to the {self.copies} copies"
        seen: set = set()
        for r, orbit in self.orbits.items():
            if len(orbit) != self.copies or orbit[0] != r:
                return f"the class of GPU {r!r} is malformed: {orbit[:4]}..."
            seen.update(orbit)
        if len(seen) != len(self.reps) * self.copies or seen != set(gpus):
            return "the classes do not partition the GPUs (one GPU in two classes, or missing)"
        return None

    def equal_within_classes(self, values: dict, what: str) -> str | None:
        """None when every GPU's value equals its representative's, else the reason."""
        for r, orbit in self.orbits.items():
            v = values.get(r)
            for g in orbit:
                w = values.get(g)
                if w != v:
                    return f"{what} of GPU {g!r} ({w}) differs from GPU {r!r}'s ({v})"
        return None

    # -- copies as points of the axes' product ---------------------------------------------------
    def digits(self, k: int) -> tuple:
        """Copy k's coordinates along the axes (the last axis fastest)."""
        out = []
        for n in reversed(self.axes):
            k, d = divmod(k, n)
            out.append(d)
        return tuple(reversed(out))

    def index(self, ds) -> int:
        """The copy at coordinates `ds` along the axes (`digits`' inverse)."""
        k = 0
        for n, d in zip(self.axes, ds, strict=True):
            k = k * n + d
        return k

    def compose(self, k: int, h: int) -> int:
        """Copy k of copy h: the two added axis by axis (modulo each axis)."""
        if len(self.axes) == 1:
            return (k + h) % self.copies
        pairs = zip(self.axes, self.digits(k), self.digits(h), strict=True)
        return self.index([(a + b) % n for n, a, b in pairs])

    def where(self, g) -> tuple:
        """(g's representative, g's copy)."""
        if self._where is None:
            self._where = {x: (r, k) for r, o in self.orbits.items() for k, x in enumerate(o)}
        return self._where[g]

    # -- what the runtime asks ---------------------------------------------------------------
    def image(self, g, k: int):
        """GPU g's image in copy k (g a representative, or any GPU: copy k of its copy)."""
        o = self.orbits.get(g)
        if o is not None:
            return o[k]
        r, h = self.where(g)
        return self.orbits[r][self.compose(k, h)]

    def images(self, gpus) -> np.ndarray:
        """An int array (len(gpus), K): row i is `image(gpus[i], k)` for every copy k (the
        GPUs numbered by ints; what a network moving flows by orbits reads)."""
        if self._table is None:
            reps = list(self.orbits)
            where = self._where_arrays(reps)
            digits = np.array([self.digits(k) for k in range(self.copies)], np.int64)
            strides = np.cumprod((1,) + self.axes[:0:-1])[::-1].astype(np.int64)
            orb = np.array([self.orbits[r] for r in reps], np.int64)
            self._table = (where, digits, strides, orb)
        (rep_of, copy_of), digits, strides, orb = self._table
        g = np.asarray(gpus, np.int64)
        if len(g) and (g.min() < 0 or g.max() >= len(rep_of) or (rep_of[g] < 0).any()):
            raise ValueError(f"a GPU outside the classes among {g[:8].tolist()}")
        ks = ((digits[copy_of[g]][:, None, :] + digits[None, :, :]) % self.axes) @ strides
        return orb[rep_of[g][:, None], ks]

    def _where_arrays(self, reps) -> tuple:
        """(each GPU's representative's index in `reps`, its copy), as arrays by GPU."""
        top = max(max(o) for o in self.orbits.values()) + 1
        rep_of, copy_of = np.full(top, -1, np.int64), np.full(top, -1, np.int64)
        for i, r in enumerate(reps):
            o = np.array(self.orbits[r], np.int64)
            rep_of[o], copy_of[o] = i, np.arange(len(o))
        return rep_of, copy_of

    def image_group(self, group: tuple, k: int) -> tuple:
        hit = self._image_groups.get((id(group), k))
        if hit is not None and hit[0] is group:
            return hit[1]
        if self._image_group is not None:
            out = tuple(self._image_group(group, k))
        else:
            out = tuple(self.image(g, k) for g in group)
        self._image_groups[id(group), k] = (group, out)
        return out

    def plan(self, group: tuple):
        """(representatives that meet for a collective over `group`, the image groups it
        also runs over, or None: it runs once over the whole group). Cached per group
        object (modes share one tuple per group)."""
        hit = self._plans.get(id(group))
        if hit is not None and hit[0] is group:
            return set(hit[1]), hit[2]  # a new set: the runtime empties it as members meet
        orbits = self.orbits
        members = [g for g in group if g in orbits]
        if not members:
            raise SymmetryBroken(f"a collective over {_short(group)} has no representative")
        if len(members) == len(group):
            ks = list(range(1, self.copies))
        else:
            ks = self._cosets(group, members)
        images = None if ks is None else [self.image_group(group, k) for k in ks]
        self._plans[id(group)] = (group, frozenset(members), images, ks)
        return set(members), images

    def image_copies(self, group: tuple) -> list:
        """The copies whose images `plan(group)` runs (in its order)."""
        self.plan(group)
        return self._plans[id(group)][3]

    def _cosets(self, group: tuple, members: list):
        """A group of representatives M at the copies H of some whole axes: None where H is
        every copy (whole classes: the group runs once), else one copy of each other coset
        k + H (its image there is another group of the full run); SymmetryBroken where the
        group is of no such form."""
        pairs = {self.where(g) for g in group}
        hs = {k for _, k in pairs}
        if (
            len(pairs) != len(group)
            or {r for r, _ in pairs} != set(members)
            or len(pairs) != len(members) * len(hs)
        ):  # pairs within M x H, as many: every representative at every copy of H
            raise SymmetryBroken(
                f"the group {_short(group)} mixes classes: neither within the representatives "
                "nor the same representatives at the same copies"
            )
        if len(hs) == self.copies:
            return None
        axes = self.axes
        moving = {a for k in hs for a, d in enumerate(self.digits(k)) if d}
        if int(np.prod([axes[a] for a in moving])) != len(hs):
            raise SymmetryBroken(
                f"the group {_short(group)} lies at copies that are not whole axes of {axes}"
            )
        rest = [range(1) if a in moving else range(n) for a, n in enumerate(axes)]
        return [k for k in map(self.index, itertools.product(*rest)) if k]

    def send_images(self, src, dst) -> list[tuple]:
        """The (source, destination) of every image of a send src -> dst (dst a
        representative, or an image: then each copy's image of it)."""
        o_src, o_dst = self.orbits[src], self.orbits.get(dst)
        if o_dst is None:
            return [(o_src[k], self.image(dst, k)) for k in range(1, self.copies)]
        return [(o_src[k], o_dst[k]) for k in range(1, self.copies)]

    def inverse(self, k: int) -> int:
        """The copy that undoes copy k (each axis negated)."""
        if len(self.axes) == 1:
            return -k % self.copies
        return self.index([-d % n for n, d in zip(self.axes, self.digits(k), strict=True)])

    # -- the streams, compared -----------------------------------------------------------------
    def sampled_copies(self) -> list[int]:
        k, n = self.copies, self.sample
        if k <= n + 1:
            return list(range(1, k))
        return sorted({int(x) for x in np.linspace(1, k - 1, n).round()})

    def check_streams(self, streams: dict) -> None:
        """Compare the streams of sampled copies with the representatives' mapped (task by
        task: types, compute times, collective ops, sizes and groups, send peers); raise
        SymmetryBroken at the first difference. Consumes the generators of `streams`."""
        names: dict = {}
        for g, s in streams:
            names.setdefault(g, []).append(s)
        ks = self.sampled_copies()
        for r in self.reps:
            for k in ks:
                g = self.orbits[r][k]
                if sorted(names.get(g, []), key=str) != sorted(names.get(r, []), key=str):
                    raise SymmetryBroken(
                        f"GPU {g!r} has streams {names.get(g)} where GPU {r!r} has {names.get(r)}"
                    )
        self.collectives, self.sends, self._seen = [], [], set()
        for r in self.reps:
            for s in names.get(r, []):
                ref = list(streams[r, s])
                for k in ks:
                    self._compare(ref, streams[self.orbits[r][k], s], k, r, s)
                self._note_calls(r, ref)

    def _note_calls(self, gpu, tasks) -> None:
        """Keep the representatives' collectives and sends, one of each call
        (`collectives`; `sends`: (source, destination, bytes)): what a run whose network
        moves flows by orbits prepares before it starts."""
        seen = self._seen
        for t in tasks:
            if type(t) is Collective:
                key = (t.op, id(t.group), float(t.nbytes), t.algorithm, t.root, id(t.sizes))
                if key not in seen:
                    seen.add(key)
                    self.collectives.append(t)
            elif type(t) is Send:
                key = (gpu, t.dst, t.nbytes)
                if key not in seen:
                    seen.add(key)
                    self.sends.append(key)

    def _compare(self, ref: list, tasks, k: int, r, stream) -> None:
        g = self.orbits[r][k]
        i = -1
        for i, b in enumerate(tasks):
            a = ref[i] if i < len(ref) else None
            why = None if a is not None and self._same_task(a, b, k) else "differs"
            if why:
                raise SymmetryBroken(
                    f"task {i} of GPU {g!r}'s {stream} stream ({_task(b)}) is "
                    f"not GPU {r!r}'s ({_task(a)}) mapped"
                )
        if i + 1 != len(ref):
            raise SymmetryBroken(
                f"GPU {g!r}'s {stream} stream has {i + 1} tasks, GPU {r!r}'s {len(ref)}"
            )

    def _same_task(self, a, b, k: int) -> bool:
        t = type(a)
        if t is not type(b):
            return False
        if t is ComputeRun:
            return a is b or (
                len(a) == len(b)
                and np.array_equal(a.durations, b.durations)
                and a.names == b.names
                and a.layers == b.layers
                and a.phases == b.phases
                and a.op_ids == b.op_ids
                and a.mbs == b.mbs
            )
        if t is Compute:
            return a == b
        if t is Collective:
            if (a.op, a.nbytes, a.algorithm, a.layer, a.phase, a.sizes) != (
                b.op,
                b.nbytes,
                b.algorithm,
                b.layer,
                b.phase,
                b.sizes,
            ):
                return False
            if (a.root is None) != (b.root is None) or (
                a.root is not None and self.image(a.root, k) != b.root
            ):
                return False
            _, images = self.plan(a.group)
            want = a.group if images is None else self.image_group(a.group, k)
            return b.group is want or tuple(b.group) == tuple(want)
        if t is Send:
            return (
                self.image(a.dst, k) == b.dst
                and a.nbytes == b.nbytes
                and a.layer == b.layer
                and a.phase == b.phase
            )
        if t is Recv:
            return self.image(a.src, k) == b.src and a.phase == b.phase
        if t is Wait and a.gpu is not None:  # another GPU's signal: its image's
            return self.image(a.gpu, k) == b.gpu
        if t is Signal or t is Wait:
            return True  # keys name the GPU; they only pair tasks of the same GPU up
        if t is WaitSome:
            return a.count == b.count and len(a.keys) == len(b.keys)
        if t is Iteration:
            return a.k == b.k
        return a == b


class Twins:
    """One operation of the representatives and its images: each image must end at the
    instant the representative's does (`SAME_INSTANT`)."""

    __slots__ = ("runtime", "what", "end", "early")

    def __init__(self, runtime, what: str):
        self.runtime, self.what = runtime, what
        self.end = None
        self.early: list = []  # ends of images that finished before the representative

    def rep_done(self, now: float) -> None:
        self.end = now
        for t in self.early:
            self._check(t)
        self.early = []

    def image_done(self, now: float) -> None:
        self.runtime.open_images -= 1
        if self.end is None:
            self.early.append(now)
        else:
            self._check(now)

    def check_all(self, end: float, images) -> None:
        """The representatives' end and every image's, all known: `image_done` of each
        and `rep_done`, as arrays (8,192 images a call at 131,072 GPUs). The same checks:
        the first image not at the same instant raises; the largest skew is kept."""
        if type(images) is list and images.count(end) == len(images):
            return  # (every image at the same instant: nothing to check, no skew)
        t = np.asarray(images, float)
        off = np.flatnonzero(t != end)
        if not len(off):
            return
        a = t[off]
        bound = SAME_INSTANT * np.maximum(np.abs(a), abs(end))
        bad = np.flatnonzero(~(np.abs(a - end) <= bound))
        if len(bad):
            self.end = end
            self._check(float(a[bad[0]]))  # raises, with its message
        skew = float(np.max(np.abs(a - end) / np.maximum(np.abs(a), abs(end))))
        rt = self.runtime
        rt.symmetry_skew = max(rt.symmetry_skew, skew)

    def _check(self, t: float) -> None:
        e = self.end
        if t != e:
            skew = abs(t - e) / max(abs(t), abs(e))
            if not same_instant(t, e):
                gap = (t - e) * 1e6
                raise SymmetryBroken(
                    f"another replica's copy of {self.what} ended {abs(gap):.3g} us "
                    f"{'after' if gap > 0 else 'before'} the representatives' (at "
                    f"{t * 1e3:.6f} ms, not {e * 1e3:.6f} ms)",
                    "the replicas do not see the "
                    "same network, e.g. a slower link in one of them, or routes that "
                    "differ per replica (ECMP on a fat tree spreads each replica's traffic "
                    "over the spines differently)",
                )
            rt = self.runtime
            rt.symmetry_skew = max(rt.symmetry_skew, skew)


def _short(group) -> str:
    g = list(group)
    return str(g) if len(g) <= 8 else f"[{', '.join(map(repr, g[:4]))}, ... {len(g)} GPUs]"


def _task(t) -> str:
    if t is None:
        return "nothing"
    if type(t) is ComputeRun:
        return repr(t)
    s = repr(t)
    return s if len(s) <= 200 else s[:200] + "..."
