"""Interval arithmetic shared by the tracer (kernel busy time) and results (stream busy time)."""

from __future__ import annotations

import numpy as np


def union_length(starts, ends) -> float:
    """Total length covered by a set of intervals [start, end)."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, float)[order], np.asarray(ends, float)[order]
    total, cur_s, cur_e = 0.0, s[0], e[0]
    for a, b in zip(s[1:], e[1:], strict=True):
        if a > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = a, b
        elif b > cur_e:
            cur_e = b
    return float(total + cur_e - cur_s)
