"""What a batch of flows puts on the links it crosses (`Footprint`), worked out once for a
batch started many times (a collective's streams, at every call).

A start adds each flow's bytes to every link of its path, one add at a time in flow order,
and to the bytes sent (networks.packet.engine). Where every flow's bytes are a whole
number and every sum stays below 2**53, each of those adds is exact, so adding each
link's total at once, or the batch's total, gives the same floats as the adds one by
one. A 64-GPU all-to-all (4,032 flows over a few hundred links, 20,000 adds) then costs
a few hundred adds per call instead; the links also answer "does the batch touch a
reserved link" without a look at every hop.
"""

from __future__ import annotations

import math

import numpy as np

EXACT = 2.0**53  # below it, sums of whole numbers are exact in doubles


class Footprint:
    """Of a batch's flows (routes' links `flat`, `nh` per flow, bytes `nb`): `links`, the
    distinct links they cross (sorted); where every flow's bytes are a whole number >= 0
    and the bytes they put on the links (sum of bytes x hops, at least 1: at least any
    link's sum and the total) stay below EXACT / 2, `sums`, the bytes they add to each of `links`, and
    `total`, their bytes; else both None."""

    __slots__ = ("links", "sums", "total")

    def __init__(self, flat: np.ndarray, nh: np.ndarray, nb: np.ndarray) -> None:
        self.links, at = np.unique(flat, return_inverse=True)
        self.sums = self.total = None
        if not len(nb) or not ((nb >= 0) & (nb == np.floor(nb))).all():
            return
        # (a bound checked before any sum: huge sizes overflow no sum here; the margin
        # covers the rounding of the bound itself)
        if nb.max() >= EXACT or float(np.dot(nb, np.maximum(nh, 1).astype(float))) >= EXACT / 2:
            return
        self.total = math.fsum(nb.tolist())  # (exact: whole numbers below EXACT)
        self.sums = np.bincount(
            at.reshape(-1), weights=np.repeat(nb, nh), minlength=len(self.links)
        )

    def add_link_bytes(self, link_bytes: np.ndarray) -> bool:
        """Add the flows' bytes to `link_bytes` where that is exact (the links' bytes now
        whole numbers >= 0, and below EXACT with these): the same floats as one add per
        flow and link in flow order. False, and nothing added, otherwise."""
        if self.sums is None:
            return False
        now = link_bytes[self.links]
        if (
            not len(now)
            or now.min() < 0.0
            or now.max() + self.sums.max() >= EXACT
            or not (now == np.floor(now)).all()
        ):
            return False
        link_bytes[self.links] = now + self.sums
        return True

    def add_to(self, acc: float) -> float | None:
        """acc plus the flows' bytes where exact (acc a whole number >= 0, the sum below
        EXACT): the same float as adding them one at a time; None otherwise."""
        if self.total is None or not acc.is_integer() or acc < 0 or acc + self.total >= EXACT:
            return None
        return acc + self.total
