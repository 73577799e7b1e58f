"""The packet network's incremental max-min solve: only what changed (`ComponentSolve`).

When flows start or end, the fast engine re-solves max-min fairness only on the connected
components of the flow-link graph that changed (`solve_changed`): components are tracked
by labels, a new flow alone on its links (a pipeline send) takes its least capacity
without looking at the table, and loads, utilisation and the done check are updated for
the changed flows and links only. Max-min rates decompose over components and the solver
computes each with the same floats alone as within the table, so this changes no bit
(`check_solves` compares every solve with the whole-table one, networks.packet.checks;
tests/test_component_solve.py). Big components hand over to networks.packet.above, which
re-solves only the flows above the level a change can reach.
"""

from __future__ import annotations

import math

import numpy as np

from networks.maxmin import max_min_rates
from networks.packet.above import SolveAbove
from networks.packet.checks import SolveChecks


class ComponentSolve:
    """The max-min rates of the flows in the table, solved again only where they changed,
    and the links' loads.

    Gives: `solve_changed()`, called once the table holds the flows of this instant (its
    change log says what changed, and is cleared), sets the table's `rate` of every flow
    to the max-min rates (bit for bit those of a whole-table solve, to round-off after a
    solve above a level), relabels the components it solved (the table's `flab`, and
    `llab`: every component within one label), delivers the flows whose rate is infinite
    (over infinitely fast links only), and returns the links whose load may have changed
    (None: no flow left). It sets `resolved` (flows it solved), `stale` (the flows whose
    rate changed, to check for done at this instant; None: all) and `solved_tail` (k >=
    0: only the last k flows changed rate; -1: unknown). `update_loads(links)` then sums
    those links' `load` (table order, as the reference engine) and the network's peak
    utilisation; `busy_links()` are those with load > 0, and `idle()` says no flow is
    left. `renumber`, `land_infinite`, the labels (`labels`, `llab`, `capped`), `finite`
    and the scratch arrays `mark` and `pos` (all False / free between uses) are for
    `above`. Counters: `alone_solves`, `component_solves`, `full_solves`,
    `round_one_solves`, `capped_solves`, `capped_skips`.

    Holds `above` (networks.packet.above: a big component's flows above a level) and
    `checks` (networks.packet.checks, run when the network's `check_solves` is set).
    Needs: the network (`capacity`, `check_solves`, the `max_utilisation` it raises), the
    flow table (networks.packet.table) and the landing (`deliver`).
    """

    def __init__(self, net, table, landing) -> None:
        self.net, self.table, self.landing = net, table, landing
        self.capacity = net.capacity
        n_links = len(self.capacity)
        self.finite = np.isfinite(self.capacity)
        # a link of capacity 0 makes the whole-table utilisation max nan (0 / 0), which
        # max() then ignores: kept as is, so the counter stays what it always was
        self.nan_util = bool((self.capacity == 0).any())
        self.mark = np.zeros(n_links, bool)  # scratch, all False between uses
        self.pos = np.zeros(n_links, np.int64)  # scratch
        # component labels (networks joined by shared finite links) of each flow and
        # link: every component within one label; -1: a new flow, or a link never used
        self.llab = np.full(n_links, -1, np.int64)
        self.labels = 0  # labels handed out so far (never reused)
        self.capped: set[int] = set()  # labels whose flows all ran at their rate cap
        self.capped_solves = self.capped_skips = self.round_one_solves = 0
        self._r1_wait = self._r1_backoff = 0  # big sets to solve without _round_one
        # flows whose rate changed at the last solve (None: all), and how many at the end
        # of the table were solved alone (-1: not only those)
        self.stale: np.ndarray | None = None
        self.solved_tail = -1
        # solves: of new flows alone on their links, of some components, of the table
        self.alone_solves = self.component_solves = self.full_solves = 0
        self.resolved = 0  # flows whose rate the last solve computed
        self.load = np.zeros(n_links)  # each link's load as of the last solve
        self.busy: np.ndarray | None = np.zeros(0, np.int64)  # links with load > 0 (None: unknown)
        self.above = SolveAbove(self)
        self.checks = SolveChecks(self)

    def busy_links(self) -> np.ndarray:
        """The links with load > 0."""
        if self.busy is None:
            self.busy = np.flatnonzero(self.load > 0)
        return self.busy

    def idle(self) -> None:
        """No flow is left: every load 0, no flow to check (the last solve saw none)."""
        self.load[:] = 0.0
        self.busy = np.zeros(0, np.int64)
        self.stale = np.zeros(0, np.int64)

    def solve_changed(self) -> np.ndarray | None:
        """Max-min rates of the flows in the connected components (links joined by the
        flows crossing them; infinite links join nothing, as they never bind) that changed
        since the last solve: those of departed flows and those joined by new flows. The
        other flows keep their rates.

        The allocation decomposes over components, and max_min_rates computes each
        component with the same floats whether alone or with others (each of its steps
        reads one link's own flows and their links; the sub-table keeps the flows' order,
        hence each link's order of sums), so the rates are those of a whole-table solve,
        bit for bit. Components are found by labels (`_relabel`): every component lies
        within one label, so the flows of the changed labels are a union of components.
        Flows with an infinite rate are delivered at once. Returns the links whose load
        may have changed, or None when no flow is left."""
        t = self.table
        seeds = t.seeds[0] if len(t.seeds) == 1 else np.concatenate(t.seeds or [[]])
        seeds = seeds.astype(np.int64, copy=False)  # links, repeats possible
        gone = np.concatenate(t.gone) if t.gone else np.zeros(0, np.int64)
        gone_links = t.gone_links
        t.seeds, t.gone, t.gone_links = [], [], []
        new, t.new = t.new, 0
        self.solved_tail = -1  # flows at the end of the table solved alone, if >= 0
        alone = self._solve_alone(seeds, new)
        if alone is not False:
            return alone
        gone = gone[gone >= 0]
        if not new and len(gone) and all(x in self.capped for x in gone.tolist()):
            # flows left components in which every flow ran at its rate cap: the shares
            # of their links only grew, so each flow still gets its cap (see _round_one)
            self.resolved = 0
            self.capped_skips += 1
            if self.net.check_solves:
                self.checks.check_rates()
            self.stale = np.zeros(0, np.int64)
            return np.unique(seeds)
        dirty, changed = self._dirty(gone, new)
        idx = np.flatnonzero(dirty)
        self.resolved = n = len(idx)
        if not n:  # the changed links lost their last flows
            self.stale = idx
            return np.unique(seeds)
        if n >= self.above.above_min:
            # the departed flows' entries (links, rates, labels), joined once for both
            gone_e = (
                tuple(np.concatenate([x[j] for x in gone_links]) for j in range(3))
                if gone_links
                else None
            )
            above = self.above.solve(idx, new, gone_e)
            if above is not None:
                return self.above.book(*above, idx, changed, new, seeds, gone_e)
        links = t.flat[t.entries(idx)]
        one = self._try_round_one(idx, links)
        capped = one is not None and one[1]
        solved = idx  # the flows whose rates may have changed
        if one is not None:
            self.round_one_solves += 1
            self.capped_solves += capped
            t.rate[idx] = one[0]
        elif n == len(t.rem):
            self.full_solves += 1
            rows, cols, capacity = t.incidence()
            t.rate[:] = max_min_rates(rows, cols, n, capacity)
        else:
            self.component_solves += 1
            t.rate[idx] = self._solve_flows(idx)
        first = self.labels
        self._relabel(idx, links)
        if capped:
            self.capped.update(range(first, self.labels))
        if self.net.check_solves:
            self.checks.check_rates()
        mark = self.mark
        mark[seeds] = True
        mark[links] = True
        touched = np.flatnonzero(mark)
        mark[touched] = False
        return touched if self.land_infinite(solved) else None

    def land_infinite(self, solved: np.ndarray) -> bool:
        """Deliver at once the flows of `solved` whose rate is infinite (over infinitely
        fast links only), else mark `solved` (new rates) to check again at this instant.
        False when no flow is left."""
        t = self.table
        inf = np.zeros(len(t.rem), bool)
        inf[solved] = np.isinf(t.rate[solved])
        if inf.any():
            self.landing.deliver(np.flatnonzero(inf))
            t.keep(~inf, seed=False)
            return len(t.rem) > 0
        self.stale = solved
        return True

    def _solve_alone(self, seeds: np.ndarray, new: int):
        """The common case of point-to-point traffic, without scanning the table: the
        `new` flows at the end of the table each alone on their links (so each is a
        component: its rate is the least capacity on its path, max_min_rates' result for
        one flow) and the other changed links (`seeds`, repeats allowed: a repeat of a
        new flow's link only sends this to the general path) without flows. Sets their rates,
        labels, loads and the peak utilisation; returns no links left to update (None: no
        flow left), or False when the changed links hold anything else (the general
        path)."""
        t = self.table
        occ = t.occ
        if new:
            nh = t.nh[-new:]
            tail = t.flat[-int(nh.sum()) :]
            if (occ[tail] != 1).any() or np.count_nonzero(occ[seeds]) != len(tail):
                return False
        elif occ[seeds].any():
            return False
        self.load[seeds] = 0.0
        self.busy = None
        self.resolved = new
        n = len(t.rem)
        self.stale = np.arange(n - new, n)
        if not new:
            self.solved_tail = 0
            return seeds[:0]
        self.alone_solves += 1
        caps = self.capacity[tail]
        rate = np.minimum.reduceat(caps, np.cumsum(nh) - nh) if new > 1 else caps.min(keepdims=True)
        rate = np.minimum(rate, t.maxr[-new:])
        t.rate[-new:] = rate
        labels = np.arange(self.labels, self.labels + new)
        self.labels += new
        t.flab[-new:] = labels
        self.llab[tail] = labels if new == 1 else np.repeat(labels, nh)
        if self.net.check_solves:
            self.checks.check_rates()
        sending = np.isfinite(rate)
        links = tail if sending.all() else tail[np.repeat(sending, nh)]
        self.load[links] = np.repeat(rate[sending], nh[sending])
        if not self.nan_util:
            fin = links[self.finite[links]]
            if len(fin):
                util = float((self.load[fin] / self.capacity[fin]).max())
                self.net.max_utilisation = max(self.net.max_utilisation, util)
        if not sending.all():  # flows over infinitely fast links only: done at once
            inf = np.zeros(len(t.rem), bool)
            inf[len(inf) - new :] = ~sending
            self.landing.deliver(np.flatnonzero(inf))
            t.keep(~inf, seed=False)
            self.stale = None
            if not len(t.rem):
                return None
        else:
            self.solved_tail = new
        return seeds[:0]

    def _try_round_one(self, idx: np.ndarray, links: np.ndarray):
        """`_round_one`, except on big sets after it failed on big sets: a failed try costs
        about a third of a solve there, so after a failure the next big sets skip it,
        twice as many each time (up to 64), until it succeeds again. Either way the rates
        are the same; this only chooses the cheaper way."""
        if len(links) <= 2048:
            return self._round_one(idx, links)
        if self._r1_wait:
            self._r1_wait -= 1
            return None
        one = self._round_one(idx, links)
        self._r1_backoff = 0 if one is not None else min(2 * self._r1_backoff or 1, 64)
        self._r1_wait = self._r1_backoff
        return one

    def _round_one(self, idx: np.ndarray, links: np.ndarray):
        """max_min_rates of the flows `idx` (a union of components; `links`: their
        entries) when its first round freezes them all, computed without building their
        incidence: (rates, whether every flow runs at its rate cap), or None when some
        flow would need another round. The same floats as max_min_rates: each link's share
        is capacity / flows on it (all of them among these flows; a rate cap is a private
        link of share cap / 1); a flow's tightest share is the least over its links; a
        link is locally minimal unless one of its flows has a tighter one (infinite links
        take no part); a flow freezes at its tightest share if one of its links is."""
        t = self.table
        if len(idx) <= self.small_flows:
            one = self._round_one_small(idx, links)
            if one is not False:
                return one
        maxr = t.maxr[idx]
        nh = t.nh[idx]
        share = self.capacity[links] / t.occ[links]  # inf on infinite links
        starts = np.cumsum(nh) - nh
        tight = np.minimum.reduceat(share, starts) if len(idx) > 1 else share.min(keepdims=True)
        tight = np.minimum(tight, maxr)
        if not np.isfinite(tight).all():
            return None  # a flow over infinite links only (rare): the solver's way
        fin = self.finite[links]
        beaten = links[fin & (np.repeat(tight, nh) < share)]  # links not locally minimal
        mark = self.mark
        mark[beaten] = True
        local = fin & ~mark[links]
        mark[beaten] = False
        capped = tight == maxr  # the private link is locally minimal
        if not (np.logical_or.reduceat(local, starts) | capped).all():
            return None
        return tight, bool(capped.all())

    def _round_one_small(self, idx: np.ndarray, links: np.ndarray):
        """`_round_one` of a few flows in plain Python: the same float operations (each
        share one division, each tight share a least value), element by element; False
        where a flow has no link (numpy's way then)."""
        t = self.table
        nh = t.nh[idx].tolist()
        if 0 in nh:
            return False
        share = (self.capacity[links] / t.occ[links]).tolist()
        ls, fin = links.tolist(), self.finite[links].tolist()
        maxr = t.maxr[idx].tolist()
        tight, e = [], 0
        for h, cap in zip(nh, maxr, strict=True):
            least = min(share[e : e + h])
            tight.append(cap if cap < least else least)
            e += h
        if not all(map(math.isfinite, tight)):
            return None
        beaten, e = set(), 0  # links not locally minimal
        for f, h in zip(tight, nh, strict=True):
            for j in range(e, e + h):
                if fin[j] and f < share[j]:
                    beaten.add(ls[j])
            e += h
        capped = [f == cap for f, cap in zip(tight, maxr, strict=True)]
        e = 0
        for c, h in zip(capped, nh, strict=True):
            if not c and not any(fin[j] and ls[j] not in beaten for j in range(e, e + h)):
                return None
            e += h
        return np.array(tight), all(capped)

    def _dirty(self, gone: np.ndarray, new: int) -> tuple[np.ndarray, np.ndarray]:
        """The flows whose rates may have changed: those sharing a label with a departed
        flow (`gone`: their labels) or with a flow on a finite link of a new flow, and
        the `new` flows at the end of the table. A link's label is that of its flows (or
        a stale one once they left: then at worst a few more flows are re-solved). Also
        returns the labels that changed."""
        t = self.table
        n = len(t.rem)
        labels = [gone]
        if new:
            tail = t.flat[len(t.flat) - int(t.nh[n - new :].sum()) :]
            labels.append(self.llab[tail[self.finite[tail]]])
        if n <= self.small_table:  # (the same sets in plain Python)
            ch = {x for part in labels for x in part.tolist() if x >= 0}
            dirty = [x in ch for x in t.flab.tolist()]
            dirty[n - new :] = [True] * new
            return np.array(dirty, bool), np.array(sorted(ch), np.int64)
        changed = np.unique(np.concatenate(labels))
        changed = changed[changed >= 0]
        if len(changed) == 1:
            dirty = t.flab == changed[0]
        elif len(changed):
            dirty = np.isin(t.flab, changed)
        else:
            dirty = np.zeros(n, bool)
        dirty[n - new :] = True
        return dirty, changed

    relabel_entries = 4096  # re-split up to this many entries into components, exactly

    def _relabel(self, idx: np.ndarray, links: np.ndarray) -> None:
        """New labels for the flows `idx` (a union of components; `links`: their entries)
        and their finite links: one per component, found by propagating the least flow
        number over shared links, when they are few; else one label for them all (still
        holding every component whole; the labels are re-split when a later change
        re-solves a part small enough)."""
        t = self.table
        k, base = len(idx), self.labels
        if 1 < k <= self.small_flows and len(links) <= self.relabel_entries:
            self._relabel_small(idx, links)
            return
        fin = self.finite[links]
        lab = None
        if 1 < k and len(links) <= self.relabel_entries:
            cols = np.repeat(np.arange(k), t.nh[idx])[fin]
            uniq, inv = self.renumber(links[fin])
            lab = np.arange(k)
            for _ in range(64):
                on_link = np.full(len(uniq), k)
                np.minimum.at(on_link, inv, lab[cols])
                nxt = lab.copy()
                np.minimum.at(nxt, cols, on_link[inv])
                if np.array_equal(nxt, lab):
                    break
                lab = nxt
            else:
                lab = None
        if lab is None:  # one label
            t.flab[idx] = base
            self.llab[links[fin]] = base
            self.labels += 1
            return
        roots, flab = np.unique(lab, return_inverse=True)
        t.flab[idx] = base + flab.reshape(-1)
        self.llab[uniq] = base + np.searchsorted(roots, on_link)
        self.labels += len(roots)

    # components of up to this many flows are solved and labelled in plain Python, tables
    # of up to small_table flows scanned so (numpy's per-call cost exceeds their work)
    small_flows = 32
    small_table = 64

    def _relabel_small(self, idx: np.ndarray, links: np.ndarray) -> None:
        """`_relabel` of a few flows (2 to `small_flows`) without numpy's per-call costs (a
        tensor-parallel collective's handful of flows is most of a symmetric LLM run's
        solves): the same components, numbered the same way (by their least flow, from
        `labels` on), each flow joined to the first flow seen on each of its finite links."""
        t, finite, llab = self.table, self.finite, self.llab
        k, base = len(idx), self.labels
        parent = list(range(k))

        def root(i):
            while parent[i] != i:
                parent[i] = i = parent[parent[i]]
            return i

        first: dict = {}  # finite link -> the first flow on it
        e = 0
        ls = links.tolist()
        for i, h in enumerate(t.nh[idx].tolist()):
            for link in ls[e : e + h]:
                if finite[link]:
                    j = first.setdefault(link, i)
                    if j != i:
                        a, b = root(i), root(j)
                        if a != b:  # the least flow is the root
                            parent[max(a, b)] = min(a, b)
            e += h
        roots = [root(i) for i in range(k)]
        number = {r: n for n, r in enumerate(sorted(set(roots)))}
        t.flab[idx] = [base + number[r] for r in roots]
        for link, i in first.items():
            llab[link] = base + number[roots[i]]
        self.labels += len(number)

    def renumber(self, links: np.ndarray):
        """np.unique(links, return_inverse=True): the distinct links in order and each
        entry's index among them; by marking the links (no sort: 4-5x faster on the tens
        of thousands of entries of a big component) unless they are few."""
        if 8 * len(links) < len(self.mark):
            uniq, rows = np.unique(links, return_inverse=True)
            return uniq, rows.reshape(-1).astype(np.int64, copy=False)
        mark, pos = self.mark, self.pos
        mark[links] = True
        uniq = np.flatnonzero(mark)
        mark[uniq] = False
        pos[uniq] = np.arange(len(uniq))
        return uniq, pos[links]

    def _solve_flows(self, idx: np.ndarray) -> np.ndarray:
        """max_min_rates of the flows `idx` (a union of components) alone, over their own
        links renumbered (which changes no float)."""
        t = self.table
        nh = t.nh[idx]
        links = t.flat[t.entries(idx)]
        maxr = t.maxr[idx]
        capped = np.flatnonzero(maxr < np.inf)
        if len(idx) == 1 and len(links) <= 8 and len(set(links.tolist())) == len(links):
            # one flow: every link's share is its capacity, so the rate is the least one
            caps = self.capacity[links]
            if len(capped):
                caps = np.append(caps, maxr[0])
            caps = caps[np.isfinite(caps)]
            return np.array([caps.min()]) if len(caps) else np.array([np.inf])
        uniq, rows = self.renumber(links)
        capacity = self.capacity[uniq]
        if len(capped):
            rows, ext = t.with_private_links(rows, nh, capped, len(uniq))
            capacity = np.concatenate([capacity, maxr[capped]])
        else:
            ext = nh
        cols = np.repeat(np.arange(len(idx)), ext)
        return max_min_rates(rows, cols, len(idx), capacity)

    def _update_loads_small(self, touched: np.ndarray) -> None:
        """`update_loads`' sums over a few flows in plain Python: each touched link's load
        summed from 0.0 over its flows in table order (bincount's sums)."""
        t = self.table
        load = dict.fromkeys(touched.tolist(), 0.0)
        ls, e = t.flat.tolist(), 0
        for r, h in zip(t.rate.tolist(), t.nh.tolist(), strict=True):
            for link in ls[e : e + h]:
                if link in load:
                    load[link] += r
            e += h
        self.load[list(load)] = list(load.values())  # (touched's repeats once)

    def update_loads(self, touched: np.ndarray) -> None:
        """Recompute the load of the links `touched` (the flows on each summed in table
        order, as link_loads sums them) and the peak utilisation: the other links carry
        the same flows at the same rates as at the last solve, so their load is unchanged
        and their utilisation already counted."""
        t = self.table
        n_links, n_entries = len(self.capacity), len(t.flat)
        many = len(touched) == n_links or (4 * len(touched) > n_entries and n_links < 3 * n_entries)
        if not many and len(t.rem) <= self.small_table:
            self._update_loads_small(touched)
        elif many:
            # many links: all of them at once is cheaper (the same sums for the others)
            self.load = np.bincount(t.flat, weights=np.repeat(t.rate, t.nh), minlength=n_links)
        else:
            rate_e = np.repeat(t.rate, t.nh)
            on = self.mark
            on[touched] = True
            sel = on[t.flat]
            on[touched] = False
            pos = self.pos
            pos[touched] = np.arange(len(touched))
            self.load[touched] = np.bincount(
                pos[t.flat[sel]], weights=rate_e[sel], minlength=len(touched)
            )
        self.busy = None
        if self.nan_util:
            return
        fin = touched[self.finite[touched]]
        if len(fin):
            util = float((self.load[fin] / self.capacity[fin]).max())
            self.net.max_utilisation = max(self.net.max_utilisation, util)
