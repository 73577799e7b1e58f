"""A symmetric run's timeline: the representatives' rows, copied to their images.

With symmetry (extrapolators.execution.symmetry) only one GPU of each class of alike GPUs
is simulated; `orbits` is {representative: (it, its images in copy order)}, every orbit of
one length. What a caller may rely on: `expand_timeline(df, orbits)` returns every GPU's
rows: copy k of the representatives' rows for each k (copy 0 their own, `df`'s row order
within each copy), the gpu column mapped to the image, and a "send to X" / "recv from X"
name naming X's image in that copy; the `key` column keeps the representative's keys.
`df` is not changed (it is returned as it is when it has no rows or one copy). `rep_of`
is the GPU -> representative map the per-GPU tables and the memory curves read.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def rep_of(gpus, orbits: dict | None) -> dict:
    """GPU -> the GPU whose rows stand for it (itself without symmetry)."""
    if orbits is None:
        return {g: g for g in gpus}
    return {g: r for r, orbit in orbits.items() for g in orbit}


def expand_timeline(df: pd.DataFrame, orbits: dict) -> pd.DataFrame:
    """Copy k of the representatives' rows for every k, gpu mapped; send/recv names
    name the mapped peer. Columnar: one take of every column, no row objects."""
    n, copies = len(df), len(next(iter(orbits.values())))
    if n == 0 or copies == 1:
        return df
    codes, uniques = pd.factorize(df["gpu"].to_numpy(), sort=False)
    uniques = list(uniques)
    if df["gpu"].dtype.kind in "iu":
        table = np.array([orbits[r] for r in uniques], dtype=np.int64).T  # (K, reps)
        gpu = table[:, codes].ravel()
    else:
        table = np.empty((copies, len(uniques)), dtype=object)
        for i, r in enumerate(uniques):
            for k, g in enumerate(orbits[r]):
                table[k, i] = g
        gpu = pd.Series(table[:, codes].ravel()).infer_objects().to_numpy()
    out = df.take(np.tile(np.arange(n), copies)).reset_index(drop=True)
    out["gpu"] = gpu
    # "send to X" / "recv from X": X is a representative; copy k's peer is its image
    names = df["name"].astype(object).to_numpy()
    by_name = {str(r): r for r in orbits}
    rows, new = [], []
    for i, name in enumerate(names):
        if isinstance(name, str) and name.startswith(("send to ", "recv from ")):
            head, _, peer = name.rpartition(" ")
            r = by_name.get(peer)
            if r is not None:
                for k in range(1, copies):
                    rows.append(k * n + i)
                    new.append(f"{head} {orbits[r][k]}")
    if rows:
        col = out["name"]
        if isinstance(col.dtype, pd.CategoricalDtype):
            col = col.cat.add_categories(sorted(set(new) - set(col.cat.categories)))
        col = col.copy()
        col.iloc[np.array(rows)] = new
        if isinstance(col.dtype, pd.CategoricalDtype):  # sorted, as the full run's
            col = col.cat.set_categories(sorted(col.cat.categories))
        out["name"] = col
    return out
