"""Checks of the packet network's incremental solves against whole-table ones (a mixin).

Tests set `check_solves` (on the class or an instance): then every solve compares the
rates with a whole-table max-min solve, every update the loads, the peak utilisation,
the flows per link and the component labels with a whole-table update; bit for bit
until a solve above a level (networks.packet.above) booked rates and loads, to
`ABOVE_CHECK_RTOL` after. A mismatch raises AssertionError. Nothing here runs unless
asked: the checks cost a whole solve each.

What the host provides: the flow table (networks.packet.table) and `_incidence_fast`,
`links`, `capacity`, `_finite`, `_load`, `_occ`, `_llab`, `max_utilisation` and the
counter `above_solves`.
"""

from __future__ import annotations

import numpy as np

from networks.maxmin import link_loads, max_min_rates


class SolveChecks:
    check_solves = False  # tests: compare every solve with the whole-table one, bit for bit
    ABOVE_CHECK_RTOL = 1e-11  # check_solves: rates after solves above a level, vs whole

    def _check_against_full(self) -> None:
        rows, cols, capacity = self._incidence_fast()
        full = max_min_rates(rows, cols, len(self._rem), capacity)
        got = self._rate
        same = (full == got) | (np.isnan(full) & np.isnan(got))
        if not self.above_solves:
            assert same.all(), ("component solve differs from the whole table", full, got)
            return
        # once flows were solved above a level, rates agree with a whole solve to round-off
        with np.errstate(invalid="ignore"):
            close = same | (np.abs(full - got) <= self.ABOVE_CHECK_RTOL * np.abs(full))
        assert close.all(), ("solve above a level differs from the whole table", full, got)

    def _check_loads(self, peak: float) -> None:
        """The loads and the peak utilisation the whole-table update gives, bit for bit (to
        round-off once solves above a level booked loads)."""
        rows, cols, _ = self._incidence_fast()
        real = rows < len(self.links)
        load = link_loads(rows[real], cols[real], self._rate, len(self.links))
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(np.isfinite(self.capacity), load / self.capacity, 0.0)
        want = max(peak, float(util.max(initial=0.0)))
        if not self.above_solves:
            assert np.array_equal(load, self._load), "loads differ from the whole-table update"
            assert want == self.max_utilisation, (want, self.max_utilisation)
        else:  # loads booked by _after_above: round-off of the largest sum on the link
            # (on an infinite link only whether it is busy counts, and a departed flow far
            # faster than the rest leaves round-off that its current load does not scale)
            scale = np.maximum(
                np.maximum(load, self._load), np.where(self._finite, self.capacity, np.inf)
            )
            bad = np.abs(load - self._load) > self.ABOVE_CHECK_RTOL * scale
            assert not bad.any(), (
                "loads differ from the whole-table update",
                load[bad],
                self._load[bad],
            )
            assert (load > 0).sum() == (self._load > 0).sum(), "a link busy in one update only"
            assert abs(want - self.max_utilisation) <= self.ABOVE_CHECK_RTOL * want
        occ = np.bincount(self._flat, minlength=len(self.links))
        assert np.array_equal(occ, self._occ), "flows per link miscounted"
        # every flow labelled, and the flows on a finite link share its label
        fin = self._finite[self._flat]
        cols = np.repeat(np.arange(len(self._nh)), self._nh)
        assert (self._flab >= 0).all(), "a flow without a component label"
        assert np.array_equal(self._flab[cols[fin]], self._llab[self._flat[fin]]), "labels"
