"""Max-min fair bandwidth allocation by progressive filling, vectorised with numpy/scipy.

Each round raises every unfrozen flow's rate equally until some link saturates; the
flows crossing the saturated links are frozen at that rate. The loop runs once per
distinct bottleneck level, never once per flow per link.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix


def incidence(flow_links: list[np.ndarray], n_links: int) -> csr_matrix:
    """Link-by-flow 0/1 matrix from each flow's list of link indices."""
    lens = np.fromiter((len(x) for x in flow_links), dtype=np.int64, count=len(flow_links))
    rows = np.concatenate(flow_links) if len(flow_links) else np.zeros(0, np.int64)
    cols = np.repeat(np.arange(len(flow_links)), lens)
    data = np.ones(len(rows))
    return csr_matrix((data, (rows, cols)), shape=(n_links, len(flow_links)))


def max_min_rates(A: csr_matrix, capacity: np.ndarray) -> np.ndarray:
    """Rates (bytes/s) of the flows (columns of A) sharing links (rows) of `capacity`.

    A flow crossing no link gets an infinite rate; links may have infinite capacity.
    """
    n_links, n_flows = A.shape
    rate = np.full(n_flows, np.inf)
    active = np.asarray(A.sum(axis=0)).ravel() > 0
    if not active.any():
        return rate
    AT = A.T.tocsr()
    cap = capacity.astype(float).copy()
    while active.any():
        n = A @ active.astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(n > 0, cap / n, np.inf)
        m = share.min()
        if not np.isfinite(m):
            break  # the rest cross only infinite links
        bottleneck = share <= m * (1 + 1e-12) + 1e-300
        newly = (AT @ bottleneck.astype(float) > 0) & active
        rate[newly] = m
        active &= ~newly
        cap = np.maximum(cap - A @ np.where(newly, m, 0.0), 0.0)
    return rate
