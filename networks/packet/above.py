"""The packet network's solve above a level: re-solving part of a big component
(`SolveAbove`).

In a big component (a data-parallel all-reduce's ring steps over shared spine links, with
pipeline sends coming and going) most changes cannot reach most flows: progressive filling
runs as before up to the least rate a change can touch, so only the flows above that level
are re-solved, over the capacity the others leave (`SolveAbove.solve`; exact up to
round-off in the residual capacities, about 1e-15 relative, checked against whole solves to
1e-11 by networks.packet.checks).
"""

from __future__ import annotations

import numpy as np

from networks.maxmin import max_min_rates


class SolveAbove:
    """The rates of a big component's flows above the level a change can reach.

    Gives (networks.packet.solve calls these for `above_min` dirty flows or more):
    `solve(idx, new, gone_e)` computes, changing nothing but counters (and restoring the
    scratch arrays), the new rates of the flows it re-solves, or None when most of `idx`
    would need solving (then the caller solves them all); `book(...)` books them: rates,
    one label for the dirty flows, and the loads of the links that changed, summed from
    what the kept flows took (not in table order: these loads agree with a whole update
    to round-off; every `RELOAD_EVERY` solves they are summed afresh, so the drift stays
    bounded). Counters: `above_solves`, `above_capped`, `reach_solves`, `tight_levels`.

    Needs: its `solver` (networks.packet.solve: `capacity`, `load` as of the last solve,
    `finite`, the labels `labels`, `llab`, `capped`, the scratch arrays `mark` and `pos`,
    `renumber`, `land_infinite`, `checks`), the flow table (networks.packet.table) and
    the network (`check_solves`, the `max_utilisation` it raises).
    """

    def __init__(self, solver) -> None:
        self.solver, self.table, self.net = solver, solver.table, solver.net
        self.capacity = solver.capacity
        self.above_solves = 0  # solves of the flows above a level only (`solve`)
        self.above_capped = 0  # ... with flows at a rate cap among them
        self.reach_solves = 0  # ... of the components a change reaches only
        self.tight_levels = 0  # ... from the rates on the new flows' links

    above_min = 1024  # dirty flows from which `solve` is tried (tests lower it)
    ABOVE_MARGIN = 1e-9  # relative: flows this close below the level are re-solved too
    RELOAD_EVERY = 1024  # solves above a level between loads summed afresh (bounds drift)
    REACH_STEPS = 12  # steps of growing the reached components before solving them all

    def solve(self, idx, new: int, gone_e):
        """Max-min rates of the dirty flows `idx` (a union of components; the last `new`
        are new; `gone_e`: the departed flows' entries as links, rates and labels, or
        None) by re-solving only those whose rates can change: (those flows, their
        rates, their distinct links, each entry's index among those links, links per flow,
        what the other flows take on each link), or None when that is most of them.

        Progressive filling raises every flow together and freezes a link's flows when
        it saturates. Below the level L it runs exactly as before the change, where L is
        the least of: the level departed flows can reach (`_departure_level`), and for each
        new flow its rate cap and capacity / flows on each of its links (the new flow adds
        at most t to a link's load at level t, and the others at most t each, so the link
        cannot saturate below that). So every flow below L keeps its rate, and the others
        get the max-min rates of the same problem with each link's capacity less what the
        flows below L take on it (the filling continued from L). What they take is the
        link's load at the last solve less the rates of the re-solved and departed flows on
        it. The rates equal a whole solve's to round-off (the residual capacities are
        summed in another order), not bit for bit."""
        s = self.solver
        t = self.table
        gl, ge, gb = gone_e if gone_e is not None else (None, None, None)
        picked = self._flows_above(idx, new, gl, ge, gb)
        if picked is None:
            return None
        above, k = picked
        solved = idx[above]
        nh = t.nh[solved]
        links = t.flat[t.entries(solved)]
        prev = t.rate[solved]
        old = prev  # new flows take nothing yet (split ring flows have rates)
        if new:
            old = old.copy()
            old[k - new :] = 0.0
        old = np.repeat(old, nh)
        uniq, rows = s.renumber(links)
        taken = np.bincount(rows, weights=old, minlength=len(uniq))
        seeds = rows[:0]
        if gl is not None:  # the departed flows' rates on these links
            mark, pos = s.mark, s.pos
            mark[uniq] = True
            pos[uniq] = np.arange(len(uniq))
            on = mark[gl]
            mark[uniq] = False
            seeds = pos[gl[on]]
            taken += np.bincount(seeds, weights=ge[on], minlength=len(uniq))
        below = np.maximum(s.load[uniq] - taken, 0.0)  # what the kept flows take
        with np.errstate(invalid="ignore"):  # inf - inf: an infinite link stays infinite
            capacity = np.where(
                s.finite[uniq],
                np.maximum(self.capacity[uniq] - below, 0.0),
                self.capacity[uniq],
            )
        maxr = t.maxr[solved]
        capped = np.flatnonzero(maxr < np.inf)
        ext, entries = nh, rows
        if len(capped):
            self.above_capped += 1
            entries, ext = t.with_private_links(rows, nh, capped, len(uniq))
            capacity = np.concatenate([capacity, maxr[capped]])
        cols = np.repeat(np.arange(k), ext)
        reach = self._reach(rows, nh, s.finite[uniq], seeds, new)
        if reach is None:
            rate = max_min_rates(entries, cols, k, capacity)
        else:  # the other components of the residual problem keep their rates
            self.reach_solves += 1
            rate = prev.copy()
            sub = reach[cols]
            rate[reach] = max_min_rates(
                entries[sub],
                (np.cumsum(reach) - 1)[cols[sub]],
                int(np.count_nonzero(reach)),
                capacity,
            )
        return solved, rate, uniq, rows, nh, below

    def _flows_above(self, idx, new: int, gl, ge, gb):
        """Which of the dirty flows `idx` to re-solve (`solve`): a mask, True for
        the new ones and those at or within ABOVE_MARGIN below the level, and how many;
        None when the level is 0 or most of them would be (`gl`, `ge`, `gb`: the departed
        flows' entries as links, rates and labels, or None)."""
        t = self.table
        n = len(t.rem)
        level = dep = np.inf if gl is None else self._departure_level(gl, ge, gb)
        if new:
            nh = t.nh[n - new :]
            if not nh.all():
                return None
            tail = t.flat[len(t.flat) - int(nh.sum()) :]
            share = self.capacity[tail] / t.occ[tail]  # inf on infinite links
            starts = np.cumsum(nh) - nh
            low = np.minimum.reduceat(share, starts) if new > 1 else share.min(keepdims=True)
            level = min(level, float(np.minimum(low, t.maxr[n - new :]).min()))
        if not level > 0:  # 0 or nan: nothing to gain
            return None

        def at_or_above(level):  # the flows to re-solve: new ones, and those near or above
            above = t.rate[idx] >= level * (1 - self.ABOVE_MARGIN)
            above[len(idx) - new :] = True
            return above, int(np.count_nonzero(above))

        above, k = at_or_above(level)
        if 2 * k > len(idx) and new:  # a second look: the rates on the new flows' links
            tight = min(dep, self._new_flow_level(tail))
            if tight > level:
                above, k = at_or_above(tight)
                self.tight_levels += 2 * k <= len(idx)
        if 2 * k > len(idx):
            return None
        return above, k

    def _reach(self, rows, nh, finite, seeds, new: int):
        """Which of the flows to re-solve above a level (their entries `rows`, indices into
        their links; `nh` per flow; `finite`: which of those links bind) share a component
        of the residual problem with a changed link (`seeds`: the departed flows' links,
        repeats allowed) or one of the `new` flows (the last ones): None when most do.

        The residual problem decomposes over its components (links joined by the flows
        crossing them, infinite links joining nothing). One that holds no changed link
        and no new flow was a component of the problem before the change too, with the
        same flows and the same residual capacities (no departed flow crossed its links),
        so its flows keep the rates of the last solve (the max-min rates of the problem
        above the same level then). Found by growing the reached set from the seeds, one
        pass over the entries per step (None after REACH_STEPS steps)."""
        k = len(nh)
        if not len(rows) or not nh.all():
            return None
        m = len(finite)
        r = np.where(finite[rows], rows, m)  # slot m: never marked (joins nothing)
        on = np.zeros(m + 1, bool)
        on[seeds] = True
        starts = np.cumsum(nh) - nh
        reach = np.zeros(k, bool)
        reach[k - new :] = True
        grown, count = reach, new  # the flows reached by the last step
        for _ in range(self.REACH_STEPS):
            if count:
                on[r[np.repeat(grown, nh)]] = True
            on[m] = False
            hit = np.logical_or.reduceat(on[r], starts)
            hit &= ~reach
            more = int(np.count_nonzero(hit))
            if not more:
                return reach
            count += more
            if 2 * count > k:
                return None
            reach |= hit
            grown = hit
        return None  # still growing: likely most of them, and each step is a pass

    def _new_flow_level(self, tail: np.ndarray) -> float:
        """A level below which the new flows (the last ones, each crossing some link;
        `tail`: their entries, the last of the table's `flat`) saturate no link, from the
        rates of the flows already on their links: on a finite link l with new flows n_l
        and old flows of rates r_1 <= ... <= r_k, the load at level t is at most f(t) = sum_i min(r_i, t) + n_l t while the old flows fill as
        before (the new ones at most t each, less when capped), so l holds until f(t) =
        c_l. Each line g_j(t) = r_1 + ... + r_j + (k - j + n_l) t lies on or above f
        (min(r_i, t) <= r_i and <= t), and on f between r_j and r_(j+1), so the root of
        f is the largest of the lines' roots (c_l - r_1 - ... - r_j) / (k - j + n_l);
        j = 0 is capacity / flows, the first bound of `solve`. Below the least
        such level over the new flows' links (and the departures' level) the filling of
        the old flows runs as before, by induction over the filling's events: a link
        without new flows sees the same loads, and one with new flows that saturated
        before at t would make f(t) >= c_l. The new flows' rate caps only lower f. The
        roots are lowered by a bound on their sums' rounding: a root a hair too high would
        leave flows just below it unsolved (the solve's margin is 1e-9 relative)."""
        s = self.solver
        t = self.table
        e_old = len(t.flat) - len(tail)
        tail = tail[s.finite[tail]]
        if not len(tail):
            return np.inf
        links, fresh = np.unique(tail, return_counts=True)
        mark = s.mark
        mark[links] = True
        pos = np.flatnonzero(mark[t.flat[:e_old]])  # the old flows' entries there
        mark[links] = False
        cap = self.capacity[links]
        level = cap / fresh  # j = k: every old flow frozen below the root
        if len(pos):
            flow = np.searchsorted(np.cumsum(t.nh), pos, side="right")
            lk, r = np.searchsorted(links, t.flat[pos]), t.rate[flow]
            order = np.lexsort((r, lk))  # by link, rates ascending within it
            lk, r = lk[order], r[order]
            k = np.bincount(lk, minlength=len(links))
            first = np.cumsum(k) - k  # each link's first entry
            j = np.arange(len(r)) - first[lk]  # rank of the rate on its link
            cs = np.concatenate(([0.0], np.cumsum(r)))  # cs[i]: the rates before entry i
            below = cs[:-1] - cs[first][lk]  # r_1 + ... + r_j on its link
            # one running sum crosses every link's rates, so its rounding (i additions of
            # rates >= 0: at most i units of cs[i]) can dwarf a slow link's own rates:
            # each root is lowered by that bound, to stay below the exact one (j = 0 has
            # nothing to round); the sums per link from bincount round on their own scale
            eps = np.finfo(float).eps
            off = np.where(j > 0, (2 * np.arange(len(r)) + 2) * eps * cs[:-1], 0.0)
            total = np.bincount(lk, weights=r, minlength=len(links))
            level = (cap - total - ((k + 1) * eps * total + eps * cap)) / fresh
            np.maximum.at(
                level, lk, (cap[lk] - below - off - eps * cap[lk]) / (k[lk] - j + fresh[lk])
            )
        return float(level.min())

    def _departure_level(self, gl, ge, gb) -> float:
        """The least level at which departed flows change the filling (their entries: link,
        rate, label; label -1: a flow that left before any solve saw it, which changes
        nothing). A departed flow's link that did not saturate (load below capacity at the
        last solve) froze nothing, and without the flow it still does not; a saturated
        link froze its last flows at the highest rate on it, at least the departed flow's
        rate and at least capacity / flows (their mean), and without the flow it saturates
        later. So the filling runs as before up to the least such bound. (The highest rate
        on the link itself, one pass over the table away, gained nothing measurable: the
        departed flow is usually the highest.)"""
        s = self.solver
        keep = gb >= 0
        if not keep.all():
            gl, ge = gl[keep], ge[keep]
        cap = self.capacity[gl]
        sat = s.finite[gl] & (s.load[gl] >= cap * (1 - self.ABOVE_MARGIN))
        if not sat.any():
            return np.inf
        gl, ge, cap = gl[sat], ge[sat], cap[sat]
        _, inv, count = np.unique(gl, return_inverse=True, return_counts=True)
        before = self.table.occ[gl] + count[inv.reshape(-1)]  # at least the flows there then
        return float(np.maximum(ge, cap / before).min())

    def book(self, solved, rate, uniq, rows, nh, below, idx, changed, new, seeds, gone_e):
        """Book a solve above a level: rates, labels and loads, each updated for what
        changed only (no pass over the table). Labels: the dirty flows keep their one
        label, new flows take it (several labels are merged into a fresh one). Loads: a
        re-solved link carries what the kept flows take plus the new rates; another link
        of a departed flow loses the departed rates (0 once it holds no flow). These sums
        are in another order than a whole-table update's, so they agree to round-off."""
        s = self.solver
        t = self.table
        self.above_solves += 1
        s.resolved = len(solved)
        t.rate[solved] = rate
        n = len(t.rem)
        if len(changed) == 1:
            lab = int(changed[0])
        else:
            lab = s.labels
            s.labels += 1
            t.flab[idx] = lab
            if len(changed):
                s.llab[np.isin(s.llab, changed)] = lab
        s.capped.difference_update(changed.tolist())
        if new:
            tail = t.flat[len(t.flat) - int(t.nh[n - new :].sum()) :]
            t.flab[n - new :] = lab
            s.llab[tail[s.finite[tail]]] = lab
        if self.net.check_solves:
            s.checks.check_rates()
        load = s.load
        fin_rate = np.where(np.isfinite(rate), rate, 0.0)
        load[uniq] = below + np.bincount(rows, weights=np.repeat(fin_rate, nh), minlength=len(uniq))
        touched = uniq
        if self.above_solves % self.RELOAD_EVERY == 0:  # now and then afresh: booked sums drift
            rate_e = np.repeat(np.where(np.isfinite(t.rate), t.rate, 0.0), t.nh)
            load[:] = np.bincount(t.flat, weights=rate_e, minlength=len(load))
            gone_e = None  # their rates are gone from these sums already
        if gone_e is not None:
            gl, ge, _ = gone_e
            mark = s.mark
            mark[uniq] = True
            other = ~mark[gl]
            mark[uniq] = False
            gl, ge = gl[other], ge[other]
            if len(gl):
                np.subtract.at(load, gl, ge)
                gl = np.unique(gl)
                load[gl] = np.where(t.occ[gl] > 0, np.maximum(load[gl], 0.0), 0.0)
                touched = np.concatenate([uniq, gl])
        s.busy = None
        if not s.nan_util:
            fin = touched[s.finite[touched]]
            if len(fin):
                util = float((load[fin] / self.capacity[fin]).max())
                self.net.max_utilisation = max(self.net.max_utilisation, util)
        return seeds[:0] if s.land_infinite(solved) else None
