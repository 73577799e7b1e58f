"""Max-min fair bandwidth allocation by progressive filling, vectorised with numpy.

The link-by-flow incidence is kept as two index arrays (link of each entry, flow of each
entry). Each round raises every unfrozen flow's rate equally until some link saturates;
the flows crossing saturated links are frozen at that rate and their entries dropped,
so later rounds work on ever smaller arrays. The loop runs once per distinct bottleneck
level, never once per flow per link.
"""

from __future__ import annotations

import numpy as np


def incidence(flow_links: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(link index, flow index) of every entry of the link-by-flow incidence."""
    lens = np.fromiter((len(x) for x in flow_links), dtype=np.int64, count=len(flow_links))
    rows = np.concatenate(flow_links) if len(flow_links) else np.zeros(0, np.int64)
    return rows.astype(np.int64, copy=False), np.repeat(np.arange(len(flow_links)), lens)


def link_loads(rows, cols, rates, n_links: int) -> np.ndarray:
    """Bytes/s on each link (finite rates only)."""
    finite = np.where(np.isfinite(rates), rates, 0.0)
    return np.bincount(rows, weights=finite[cols], minlength=n_links)


def max_min_rates(rows, cols, n_flows: int, capacity: np.ndarray) -> np.ndarray:
    """Rates (bytes/s) of `n_flows` flows over links of `capacity`, given the incidence
    entries (rows: link, cols: flow). A flow crossing no link, or only links of infinite
    capacity, gets an infinite rate."""
    rate = np.full(n_flows, np.inf)
    cap = capacity.astype(float).copy()
    n_links = len(cap)
    while len(rows):
        n = np.bincount(rows, minlength=n_links)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(n > 0, cap / n, np.inf)
        m = share.min()
        if not np.isfinite(m):
            break  # the rest cross only infinite links
        bottleneck = share <= m * (1 + 1e-12) + 1e-300
        newly = np.zeros(n_flows, bool)
        newly[cols[bottleneck[rows]]] = True
        rate[newly] = m
        hit = newly[cols]  # entries of the flows frozen now: they take m from their links
        cap = np.maximum(cap - np.bincount(rows[hit], minlength=n_links) * m, 0.0)
        rows, cols = rows[~hit], cols[~hit]
    return rate
