"""Lengths of unions of intervals, bit for bit as the reference loop
(`triosim.common.intervals.union_length`) computes them, in numpy.

What a caller may rely on: `union_sorted(s, e)` equals `union_length(s, e)` for intervals
already sorted by start, and `union_lengths(codes, s, e, n)[g]` equals `union_sorted` of
group g's intervals (in any order: they are sorted here), 0.0 for a group with none; the
same float, not merely a close one (the busy-time breakdown of `Result.per_gpu` must not
depend on which path computed it). What it must provide: float arrays of one length,
group codes 0..n-1.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def union_sorted(s: np.ndarray, e: np.ndarray) -> float:
    """`union_length` of intervals already sorted by start, in numpy: the same merged
    segments (an interval starting after every earlier end opens one) and the same float
    sums in the same order (np.cumsum adds left to right), so the same value."""
    if len(s) == 0:
        return 0.0
    reach = np.maximum.accumulate(e)  # the current segment's end, as the loop's cur_e
    opens = np.flatnonzero(s[1:] > reach[:-1]) + 1
    starts = s[np.r_[0, opens]]
    ends = reach[np.r_[opens - 1, len(s) - 1]]
    total = np.cumsum(ends[:-1] - starts[:-1])[-1] if len(opens) else 0.0
    return float(total + ends[-1] - starts[-1])


PAD_LIMIT = 2**24  # cells of the groups x segments matrix `union_lengths` may build


def union_lengths(codes: np.ndarray, s: np.ndarray, e: np.ndarray, n: int) -> np.ndarray:
    """`union_sorted` of each group's intervals (group codes 0..n-1), all groups at once:
    the same merged segments (a running max of the ends per group: a max is exact) and the
    same float sums in the same order (the lengths of a group's segments but its last
    summed left to right, in a row of a zero-padded matrix: `np.cumsum` along a row adds
    left to right, and adding zeros after changes nothing; then + end - start of the last,
    as `union_sorted` does), so the same values."""
    out = np.zeros(n)
    if not len(s):
        return out
    order = np.lexsort((s, codes))
    c, s, e = codes[order], s[order], e[order]
    reach = pd.Series(e).groupby(c, sort=False).cummax().to_numpy()
    opens = np.ones(len(s), bool)  # a group's first interval, or one after every earlier end
    opens[1:] = (c[1:] != c[:-1]) | (s[1:] > reach[:-1])
    first = np.flatnonzero(opens)
    seg_c, seg_s = c[first], s[first]
    seg_e = reach[np.r_[first[1:] - 1, len(s) - 1]]
    # per group: its segments' range, the last one apart
    lo = np.searchsorted(seg_c, np.arange(n))
    hi = np.searchsorted(seg_c, np.arange(n), side="right")
    has = hi > lo
    last = hi[has] - 1
    k = hi - lo - 1  # segments before the last
    width = int(k.max(initial=0))
    total = np.zeros(n)
    if width and n * width <= PAD_LIMIT:
        pad = np.zeros((n, width))  # row: a group; column: its segment's rank in it
        not_last = np.ones(len(seg_s), bool)
        not_last[last] = False
        rank = np.arange(len(seg_s)) - lo[seg_c]
        pad[seg_c[not_last], rank[not_last]] = (seg_e - seg_s)[not_last]
        many = k > 0
        total[many] = np.cumsum(pad[many], axis=1)[np.arange(int(many.sum())), k[many] - 1]
    elif width:  # a group with very many segments: one cumsum per group
        for g in np.flatnonzero(k > 0).tolist():
            total[g] = np.cumsum(seg_e[lo[g] : hi[g] - 1] - seg_s[lo[g] : hi[g] - 1])[-1]
    out[has] = total[has] + seg_e[last] - seg_s[last]
    return out
