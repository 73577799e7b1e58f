"""The breakdown tables of one run: per GPU (compute, communication, exposed communication,
idle) and per GPU and layer, over the last (steady-state) iteration.

`Result.per_gpu` and `Result.per_layer` are the callers; they hand over plain values, so
that nothing here knows of symmetry or of the runtime's log:

- `per_gpu_table(busy, gpus, rep_of, iteration_time)` takes the iteration's busy intervals
  (`Busy`, from `busy_of_log` or `busy_of_timeline`: the same union lengths either way) and
  a GPU -> representative map (empty: every GPU stands for itself); a GPU whose
  representative ran no task gets zeros.
- `per_layer_table(timeline, gpus, iteration)` takes the whole timeline (every GPU's rows).

Both return fresh DataFrames the caller may keep; times are seconds.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from triosim.results.unions import union_lengths


class Busy(NamedTuple):
    """One iteration's compute and communication intervals, every GPU's together: `codes`
    index `uniques` (the GPUs that ran any), one entry per interval in the arrays."""

    codes: np.ndarray
    uniques: object
    start: np.ndarray
    end: np.ndarray
    is_comp: np.ndarray
    is_comm: np.ndarray


def busy_of_log(log, iteration: int) -> Busy:
    """From the runtime's log (extrapolators.execution.timeline_log.TimelineLog)."""
    gpus, start, end, is_comp, is_comm = log.busy(iteration)
    # (a Series keeps a tuple GPU whole, where numpy would make it a row)
    codes, uniques = pd.factorize(pd.Series(gpus, dtype=object), sort=False)
    return Busy(codes, uniques, start, end, is_comp, is_comm)


def busy_of_timeline(tl: pd.DataFrame, iteration: int) -> Busy:
    """From a timeline table (COLUMNS)."""
    last = (tl["iteration"] == iteration).to_numpy(bool)
    # one sort by (gpu, start) for all GPUs, then a slice per GPU (no pandas per GPU); the
    # order of equal starts does not change a union's length. Numpy columns: a pandas row
    # selection would copy every column, strings included
    codes, uniques = pd.factorize(tl["gpu"].to_numpy()[last], sort=False)
    start, end = tl["start"].to_numpy(float)[last], tl["end"].to_numpy(float)[last]
    is_comp = (tl["kind"] == "compute").to_numpy(bool)[last]
    is_comm = (tl["kind"] == "comm").to_numpy(bool)[last]
    return Busy(codes, uniques, start, end, is_comp, is_comm)


def per_gpu_table(busy: Busy, gpus, rep_of: dict, iteration_time: float) -> pd.DataFrame:
    """Per GPU (the index, in `gpus` order): compute, comm, exposed_comm, idle."""
    codes, uniques, start, end = busy.codes, busy.uniques, busy.start, busy.end
    where = {g: k for k, g in enumerate(uniques)}

    def unions(mask):  # per GPU code: the union of its intervals' lengths
        return union_lengths(codes[mask], start[mask], end[mask], len(uniques)).tolist()

    comp_u, comm_u = unions(busy.is_comp), unions(busy.is_comm)
    both_u = unions(busy.is_comp | busy.is_comm)
    out = []
    for g in gpus:
        k = where.get(rep_of.get(g, g))
        c = comp_u[k] if k is not None else 0.0
        m = comm_u[k] if k is not None else 0.0
        both = both_u[k] if k is not None else 0.0
        out.append(
            {
                "gpu": g,
                "compute": c,
                "comm": m,
                "exposed_comm": both - c,
                "idle": max(iteration_time - both, 0.0),
            }
        )
    return pd.DataFrame(out).set_index("gpu")


def per_layer_table(timeline: pd.DataFrame, gpus, iteration: int) -> pd.DataFrame:
    """One row per (gpu, layer) with columns gpu, layer, compute, comm (seconds of that
    GPU's tasks of the layer in `iteration`; "(none)" for tasks of no layer). GPUs in
    `gpus` order, layers in the order the GPU first ran them."""
    tl = timeline
    d = tl[(tl["iteration"] == iteration) & tl["kind"].isin(["compute", "comm"])]
    d = d.assign(
        duration=d["end"] - d["start"],
        layer=_renamed(d["layer"], "", "(none)"),
        order=d["gpu"].map({g: i for i, g in enumerate(gpus)}),
    )
    d = d.sort_values(["order", "start"], kind="stable")
    table = d.pivot_table(
        index=["gpu", "layer"],
        columns="kind",
        values="duration",
        aggfunc="sum",
        fill_value=0.0,
        sort=False,
    )
    for k in ("compute", "comm"):
        if k not in table:
            table[k] = 0.0
    out = table[["compute", "comm"]].reset_index()
    out.columns.name = None
    return out


def _renamed(col: pd.Series, old, new) -> pd.Series:
    """`col` with `old` replaced by `new`; a categorical column renames the category."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        if old not in col.cat.categories:
            return col
        if new in col.cat.categories:
            return col.astype(object).replace(old, new)
        return col.cat.rename_categories({old: new})
    return col.replace(old, new)
