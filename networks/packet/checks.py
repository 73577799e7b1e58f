"""Checks of the packet network's incremental solves against whole-table ones
(`SolveChecks`).

Tests set the network's `check_solves` (on the class or an instance): then every solve
compares the rates with a whole-table max-min solve, every update the loads, the peak
utilisation, the flows per link and the component labels with a whole-table update; bit
for bit until a solve above a level (networks.packet.above) booked rates and loads, to
`ABOVE_CHECK_RTOL` after. A mismatch raises AssertionError. Nothing here runs unless
asked: the checks cost a whole solve each.
"""

from __future__ import annotations

import numpy as np

from networks.maxmin import link_loads, max_min_rates


class SolveChecks:
    """Whole-table checks of a solver's work.

    Gives: `check_rates()` (the table's rates against a whole-table max-min solve) and
    `check_loads(peak)` (the solver's loads, the network's peak utilisation, the table's
    flows per link and the labels against a whole-table update); each raises
    AssertionError on a mismatch. Needs: the `solver` (networks.packet.solve: `load`,
    `finite`, `llab`, `capacity`, and its `above`'s `above_solves`), its flow table and
    the network's `max_utilisation`.
    """

    ABOVE_CHECK_RTOL = 1e-11  # check_solves: rates after solves above a level, vs whole

    def __init__(self, solver) -> None:
        self.solver, self.table, self.net = solver, solver.table, solver.net
        self.capacity = solver.capacity

    def check_rates(self) -> None:
        """The rates a whole-table max-min solve gives, bit for bit (to round-off once
        solves above a level booked rates)."""
        t = self.table
        rows, cols, capacity = t.incidence()
        full = max_min_rates(rows, cols, len(t.rem), capacity)
        got = t.rate
        same = (full == got) | (np.isnan(full) & np.isnan(got))
        if not self.solver.above.above_solves:
            assert same.all(), ("component solve differs from the whole table", full, got)
            return
        # once flows were solved above a level, rates agree with a whole solve to round-off
        with np.errstate(invalid="ignore"):
            close = same | (np.abs(full - got) <= self.ABOVE_CHECK_RTOL * np.abs(full))
        assert close.all(), ("solve above a level differs from the whole table", full, got)

    def check_loads(self, peak: float) -> None:
        """The loads and the peak utilisation the whole-table update gives, bit for bit (to
        round-off once solves above a level booked loads)."""
        s = self.solver
        t = self.table
        rows, cols, _ = t.incidence()
        real = rows < len(self.capacity)
        load = link_loads(rows[real], cols[real], t.rate, len(self.capacity))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(self.capacity), load / self.capacity, 0.0)
        want = max(peak, float(util.max(initial=0.0)))
        if not s.above.above_solves:
            assert np.array_equal(load, s.load), "loads differ from the whole-table update"
            assert want == self.net.max_utilisation, (want, self.net.max_utilisation)
        else:  # loads booked by SolveAbove.book: round-off of the largest sum on the link
            # (on an infinite link only whether it is busy counts, and a departed flow far
            # faster than the rest leaves round-off that its current load does not scale)
            scale = np.maximum(np.maximum(load, s.load), np.where(s.finite, self.capacity, np.inf))
            bad = np.abs(load - s.load) > self.ABOVE_CHECK_RTOL * scale
            assert not bad.any(), (
                "loads differ from the whole-table update",
                load[bad],
                s.load[bad],
            )
            assert (load > 0).sum() == (s.load > 0).sum(), "a link busy in one update only"
            assert abs(want - self.net.max_utilisation) <= self.ABOVE_CHECK_RTOL * want
        occ = np.bincount(t.flat, minlength=len(self.capacity))
        assert np.array_equal(occ, t.occ), "flows per link miscounted"
        # every flow labelled, and the flows on a finite link share its label
        fin = s.finite[t.flat]
        cols = np.repeat(np.arange(len(t.nh)), t.nh)
        assert (t.flab >= 0).all(), "a flow without a component label"
        assert np.array_equal(t.flab[cols[fin]], s.llab[t.flat[fin]]), "labels"
