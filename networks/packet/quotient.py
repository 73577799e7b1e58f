"""A symmetric run's network by orbits: the representatives' flows only (`Quotient`).

A symmetric run (extrapolators.execution.symmetry) starts every collective and send of
its representatives together with the same operation in every other copy: K copies of
each flow, which the full network moves one by one. When the copies see the same network,
the max-min rates of a flow's K copies are equal, and the network can move one flow per
orbit instead:

* a transfer group is the union of whole orbits of flows: each flow from a representative
  (copy 0) and its K - 1 images (copy k: the source's and the destination's images in
  copy k), with the same size and rate cap; checked, else `QuotientBroken`;
* the links split into classes: at each position of a path, the links the K copies of the
  flow cross there (with a G-action on the links these are orbits). A class is kept as
  one link, its smallest, of capacity C x |class| / K: the K copies cross the class's
  links evenly, K / |class| flows of the orbit on each, so a link's constraint sum over
  flows x rate <= C reads, per orbit, (K / |class|) x rate <= C. Checked for every path
  (each link in one class only, the copies spread evenly over it, equal capacity and
  latency within it, no path through a class twice), else `QuotientBroken`.

Why the rates are the full network's: progressive filling raises every flow's rate
together; a link of a class saturates when every link of it does (equal capacity, equal
count of each orbit's flows), so the flows frozen at each step are whole orbits, and what
is left of each link's capacity stays equal within its class. The orbits' rates are then
the quotient's. (The floats differ from the full run's by round-off: C x |class| / K
instead of K / |class| sums of a rate.)

What the run reads of the network is the full run's: each transfer group's records (the
images' ends are their representative flow's), `bytes_sent` and `bytes_delivered`,
`in_flight`, the log, and `link_stats` (a class's links each carry K / |class| times the
bytes of its kept link).
"""

from __future__ import annotations

import numpy as np

from networks.groups import Group
from triosim.common.errors import QuotientBroken


class Quotient:
    """The network's flows by orbits of a symmetric run's copies.

    Gives: `prepare(srcs, dsts, sizes, caps)` (a batch of the kept flows, each with its
    class path, and `expand`: each transfer's kept flow), `start_all(b, tag, done)` and
    `start_group(b, tag)` (transfer_all's and transfer_group's starts of such a batch),
    `link_stats_columns()` (bytes and busy time of every link, as the full run's).

    Needs: the network (`capacity`, `latency`, `_routes`, its engine, counters and log)
    and `copies`: `copies` (K), `reps` (the representative GPUs, ints) and
    `images(gpus)` (an int array (len(gpus), K): each GPU's image in every copy).
    """

    def __init__(self, net, copies) -> None:
        self.net, self.k = net, int(copies.copies)
        self.images = copies.images
        reps = np.asarray(list(copies.reps))
        if reps.dtype.kind not in "iu":
            raise QuotientBroken("the GPUs are not numbered by ints")
        self.is_rep = np.zeros(int(reps.max()) + 1, bool)
        self.is_rep[reps] = True
        self.capacity0 = net.capacity.copy()  # as built (the kept links' are scaled)
        n = len(net.capacity)
        self.canon = np.full(n, -1, np.int64)  # each link's class (its kept link), -1: none
        self.size = np.zeros(n, np.int64)  # a kept link's class size
        self._paths: dict = {}  # (src, dst) -> (class path, its latency)
        self._kept: dict = {}  # small transfer groups prepared: (srcs, dsts, ...) -> batch
        self._kept_transfers = 0

    # -- transfers -------------------------------------------------------------------------
    KEEP = 4096  # transfers up to which a prepared group is kept (a pipeline's sends repeat)
    KEEP_ALL = 2_000_000  # transfers in all the kept groups

    def prepare(self, srcs, dsts, sizes, caps):
        """The kept flows of `srcs[i] -> dsts[i]` as a network batch (see the module);
        small groups kept, as a symmetric run's sends and their images come again."""
        if len(srcs) > self.KEEP:
            return self._prepare(srcs, dsts, sizes, caps)
        key = (tuple(srcs), tuple(dsts), tuple(sizes), tuple(caps))
        b = self._kept.get(key)
        if b is None:
            b = self._prepare(srcs, dsts, sizes, caps)
            if self._kept_transfers + len(srcs) <= self.KEEP_ALL:
                self._kept[key] = b
                self._kept_transfers += len(srcs)
        return b

    def _prepare(self, srcs, dsts, sizes, caps):
        s, d = _ints(srcs), _ints(dsts)
        if (s < 0).any() or (d < 0).any():
            raise QuotientBroken("a transfer to or from a node that is no GPU of the copies")
        nb, mx = np.asarray(sizes, float), np.asarray(caps, float)
        n, k = len(s), self.k
        rep = self.is_rep
        keep = np.zeros(n, bool)
        inside = s < len(rep)
        keep[inside] = rep[s[inside]]
        kept = np.flatnonzero(keep)
        if len(kept) * k != n:
            raise QuotientBroken(
                f"a transfer group of {n} transfers is not {k} copies of its {len(kept)} "
                "from representatives"
            )
        expand = self._orbits(s, d, nb, mx, kept)
        routes = [self._path(int(a), int(b)) for a, b in zip(s[kept], d[kept], strict=True)]
        nh = np.fromiter((len(r[0]) for r in routes), np.int64, count=len(routes))
        flat = np.concatenate([r[0] for r in routes]) if routes else np.zeros(0, np.int64)
        lat = np.array([r[1] for r in routes], float)
        net = self.net
        ks = kept.tolist()
        full = (list(srcs), list(dsts), nb, mx)
        return net.batch_of(
            [srcs[i] for i in ks], [dsts[i] for i in ks], nb[kept], mx[kept], flat, nh, lat,
            full=full, expand=expand,
        )  # fmt: skip

    def _orbits(self, s, d, nb, mx, kept) -> np.ndarray:
        """Each transfer's kept flow (index into `kept`): the transfers must be exactly the
        kept flows' images in every copy, sizes and caps alike."""
        k = self.k
        img_s, img_d = self._images(s[kept]), self._images(d[kept])  # (kept, K) each
        owner = np.repeat(np.arange(len(kept)), k)
        cols = (img_s.ravel(), img_d.ravel(), np.repeat(nb[kept], k), np.repeat(mx[kept], k))
        o_img = np.lexsort(cols[::-1])
        o_all = np.lexsort((mx, nb, d, s))
        same = all(
            np.array_equal(a[o_img], b[o_all]) for a, b in zip(cols, (s, d, nb, mx), strict=True)
        )
        if not same:
            raise QuotientBroken(
                "a transfer group is not its representatives' transfers in every copy "
                "(a collective whose streams the copies do not map onto each other)"
            )
        expand = np.empty(len(s), np.int64)
        expand[o_all] = owner[o_img]
        return expand

    def _path(self, a: int, b: int):
        """(the class path of a -> b, its latency), found from the K copies' routes."""
        hit = self._paths.get((a, b))
        if hit is not None:
            return hit
        img = self._images(np.array([a, b]))
        routes = self.net._routes(list(zip(img[0].tolist(), img[1].tolist(), strict=True)))
        m = len(routes[0][0])
        if any(len(r[0]) != m for r in routes):
            raise QuotientBroken(f"the copies of {a} -> {b} take paths of different lengths")
        path = np.empty(m, np.int64)
        if m:
            grid = np.stack([r[0] for r in routes])  # (K, m)
            for i in range(m):
                path[i] = self._class(grid[:, i], a, b)
            if len(set(path.tolist())) != m:
                raise QuotientBroken(f"the path {a} -> {b} crosses a class of links twice")
        out = (path, routes[0][1])
        self._paths[a, b] = out
        return out

    def _images(self, gpus) -> np.ndarray:
        """`copies.images`, a node outside the copies' orbits refused (a switch named by
        an int)."""
        try:
            return self.images(gpus)
        except (IndexError, KeyError, ValueError) as e:
            raise QuotientBroken(f"a transfer to or from a node outside the copies ({e})") from None

    def _class(self, col: np.ndarray, a, b) -> int:
        """The kept link of the class the K copies' links `col` form (made on first sight)."""
        links, counts = np.unique(col, return_counts=True)
        if (counts != counts[0]).any():
            raise QuotientBroken(f"the copies of {a} -> {b} share a link unevenly")
        net = self.net
        c = self.canon[links]
        if (c >= 0).any():
            if (c != c[0]).any() or c[0] < 0 or self.size[c[0]] != len(links):
                raise QuotientBroken(
                    f"the copies of {a} -> {b} cross links that other flows' copies group "
                    "otherwise (the copies do not see the same network)"
                )
            return int(c[0])
        cap, lat = self.capacity0[links], net.latency[links]
        if (cap != cap[0]).any() or (lat != lat[0]).any():
            raise QuotientBroken(
                f"the copies of {a} -> {b} cross links of different bandwidth or latency"
            )
        kept = int(links[0])
        self.canon[links] = kept
        self.size[kept] = len(links)
        net.capacity[kept] = self.capacity0[kept] * len(links) / self.k
        return kept

    def start_all(self, b, tag: str, done):
        """transfer_all of a prepared batch: `done` (an event, or a networks.groups.Then)
        is succeeded with every transfer's record."""
        env = self.net.env
        full = Group(*b.full, env.now, tag, None, done)
        kept = Group(b.srcs, b.dsts, b.nb, b.maxr, env.now, tag, None, None)
        kept.done = _Landed(self, kept, full, b)  # at once, as the full group's done
        self._start(b, kept, full)
        return done

    def start_group(self, b, tag: str) -> list:
        """transfer_group of a prepared batch: each transfer's event; an image's is its
        kept flow's event (fires at the same instant; its value the kept flow's record)."""
        net = self.net
        env = net.env
        events = [env.event() for _ in b.srcs]
        full = Group(*b.full, env.now, tag, None, None)
        kept = Group(b.srcs, b.dsts, b.nb, b.maxr, env.now, tag, events)
        self._start(b, kept, full)
        parts, expand = b.by_kept()
        for ev, mine in zip(events, parts, strict=True):

            def landed(_e, mine=mine):
                full.ends[mine] = env.now
                nb = full.nb[mine]
                self._landed(float(np.sum(nb)) - float(np.sum(nb[:1])), len(mine) - 1)

            ev.callbacks.append(landed)
        return [events[j] for j in expand]

    def _start(self, b, kept: Group, full: Group) -> None:
        """The kept flows start; the network's log and counters read the full group."""
        net = self.net
        net._engine.start(kept, b.flat, b.nh, b.lat, alone=b.alone, footprint=b.footprint)
        net._log[-1] = full
        net.bytes_sent += b.extra_bytes  # (full.nb's sum less kept.nb's)
        net.in_flight += len(full.nb) - len(kept.nb)

    def _landed(self, extra_bytes: float, extra: int) -> None:
        """The images' transfers landed with their kept flows: `extra_bytes` (the full
        group's bytes less the kept flows', as float sums) and `extra` transfers."""
        net = self.net
        net.bytes_delivered += extra_bytes
        net.in_flight -= extra

    # -- what the run reads --------------------------------------------------------------
    def link_stats_columns(self, link_bytes, link_busy):
        """(capacity, bytes, busy time) of every link as in the full run: a class's links
        each carry K / |class| times its kept link's bytes, busy as long."""
        c = self.canon
        on = c >= 0
        nbytes, busy = np.zeros(len(c)), np.zeros(len(c))
        nbytes[on] = link_bytes[c[on]] * (self.k / self.size[c[on]])
        busy[on] = link_busy[c[on]]
        return self.capacity0, nbytes, busy


class _Landed:
    """The kept group's `done`: when its last flow lands (Landing calls `succeed`), the full
    group's ends, counters and done event, at once (no event step between)."""

    __slots__ = ("q", "kept", "full", "batch")

    def __init__(self, q, kept, full, batch):
        self.q, self.kept, self.full, self.batch = q, kept, full, batch

    @property
    def calls_back(self) -> bool:
        """Whether succeeding runs a callback (the full group's done is a Then)."""
        return getattr(self.full.done, "calls_back", False)

    def succeed(self, _records=None) -> None:
        full, kept, b = self.full, self.kept, self.batch
        full.ends[:] = kept.ends[b.expand]
        self.q._landed(b.extra_bytes, len(full.nb) - len(kept.nb))  # (sums made once)
        full.finish()


def _ints(nodes) -> np.ndarray:
    """The nodes as an int64 array (-1 for any that is not an int: a switch)."""
    if isinstance(nodes, np.ndarray) and nodes.dtype.kind in "iu":
        return nodes.astype(np.int64, copy=False)
    return np.fromiter((x if type(x) is int else -1 for x in nodes), np.int64, count=len(nodes))
