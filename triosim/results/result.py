"""What a run returns: iteration time, timeline and breakdowns as DataFrames, and exports.

Times are seconds and sizes bytes in every DataFrame; `summary()` and the CLI print ms.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

from extrapolators.execution.timeline_log import COLUMNS, TimelineLog


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


def _renamed(col: pd.Series, old, new) -> pd.Series:
    """`col` with `old` replaced by `new`; a categorical column renames the category."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        if old not in col.cat.categories:
            return col
        if new in col.cat.categories:
            return col.astype(object).replace(old, new)
        return col.cat.rename_categories({old: new})
    return col.replace(old, new)


def _intervals(df):
    return df["start"].to_numpy(), df["end"].to_numpy()


class Result:
    """A plain record of one run: picklable, holding no live simulation objects.

    `timeline` has one row per task (COLUMNS); `per_link()` one row per link direction
    with the same columns for every network; `config` is the resolved Config.
    """

    def __init__(
        self,
        rows,
        gpus,
        config,
        links,
        transfers,
        collective_bytes,
        bytes_delivered,
        network_stats,
        wall_time,
        trace=None,
        orbits=None,
    ):
        # `orbits` (symmetry, extrapolators.execution.symmetry): {representative: (it, its images in
        # copy order)}; `rows` are then the representatives' only. The timeline of an image
        # is its representative's rows with the gpu (and the peer named in "send to" /
        # "recv from") mapped; the `key` column keeps the representative's keys. It is built
        # on first use of `timeline`; iteration times, `per_gpu` and memory come from the
        # representatives' rows, copied per class (the same numbers: the rows are copies).
        # No copy of the columns: they are fresh arrays (stacking them into 2D blocks took
        # 1.7 s and doubled the timeline's memory at 16,384 GPUs).
        # `rows` may be the runtime's log (extrapolators.execution.timeline_log.TimelineLog): the
        # table is then built on first use of `own_timeline` / `timeline` (at 16,384 GPUs,
        # tens of millions of rows and a quarter of the run), and the iteration times and
        # `per_gpu` are read from the log
        self._log = rows if isinstance(rows, TimelineLog) else None
        self._own = (
            None if self._log is not None else pd.DataFrame(rows, columns=list(COLUMNS), copy=False)
        )
        self._orbits = orbits
        self._timeline = None
        self.symmetry = "off"  # what ran: "off", "auto: ..." or "off (fell back: <why>)"
        self.symmetry_skew = 0.0  # largest relative gap between an image's end and its rep's
        self.gpus = list(gpus)
        self.config = config
        if self._log is not None:
            ends = self._log.iteration_ends()
        else:
            tl = self._own
            ends = tl.groupby("iteration")["end"].max().sort_index() if len(tl) else [0.0]
        # iteration k ends when its last task does; its time is measured from the end of k-1
        self.iteration_ends = [float(x) for x in ends]
        starts = [0.0, *self.iteration_ends[:-1]]
        self.iteration_times = [b - a for a, b in zip(starts, self.iteration_ends, strict=True)]
        self.first_iteration_time = self.iteration_times[0]
        self.iteration_time = self.iteration_times[-1]  # the steady state when iterations > 1
        self.total_time = self.iteration_ends[-1]
        links = links.rename(columns={"bytes": "nbytes"})  # one name for bytes in every table
        links["utilisation"] = links["busy_time"] / self.total_time if self.total_time else 0.0
        self.links = links
        self._transfers = transfers  # a DataFrame, or a callable that builds it
        self.collective_bytes = dict(collective_bytes)
        self.bytes_delivered = float(bytes_delivered)
        self.network_stats = dict(network_stats)
        self.wall_time = wall_time
        self.trace = trace  # only for a trace passed in memory: saved beside the config
        self._per_gpu = None  # the timeline is final: compute the breakdown once
        self._memory = pd.DataFrame()  # gpu, time, bytes per category and total
        self.peak_memory: dict = {}  # GPU -> peak bytes
        self.memory_capacity: float | None = None  # bytes usable by tensors (after reserve)

    # -- symmetry: the representatives' rows, copied to their images on first use ----------------
    @property
    def own_timeline(self) -> pd.DataFrame:
        """The simulated GPUs' rows (with symmetry: the representatives')."""
        if self._own is None:
            self._own = pd.DataFrame(self._log.columns(), columns=list(COLUMNS), copy=False)
            self._log = None  # the table holds it all now
        return self._own

    @property
    def timeline(self) -> pd.DataFrame:
        """One row per task of every GPU (COLUMNS)."""
        if self._timeline is None:
            own = self.own_timeline
            self._timeline = self._expand_timeline(own) if self._orbits else own
        return self._timeline

    @timeline.setter
    def timeline(self, value) -> None:
        """Replace the timeline (of every GPU): the classes no longer apply."""
        self._timeline = self._own = value
        self._log, self._orbits, self._per_gpu = None, None, None

    def _rep_of(self) -> dict:
        """GPU -> the GPU whose rows stand for it (itself without symmetry)."""
        if self._orbits is None:
            return {g: g for g in self.gpus}
        return {g: r for r, orbit in self._orbits.items() for g in orbit}

    def _expand_timeline(self, df: pd.DataFrame) -> pd.DataFrame:
        """Copy k of the representatives' rows for every k, gpu mapped; send/recv names
        name the mapped peer. Columnar: one take of every column, no row objects."""
        orbits = self._orbits
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

    @property
    def memory(self) -> pd.DataFrame:
        """gpu, time, bytes per category and total: one row per GPU and instant where its
        memory changes, GPUs in order (built on first use from the per-GPU curves)."""
        if not isinstance(self._memory, pd.DataFrame):
            self._memory = self._memory.frame()
        return self._memory

    @memory.setter
    def memory(self, value) -> None:
        self._memory = value

    def set_memory(self, memory, peaks: dict, capacity: float | None, reserve: float) -> None:
        """Attach the memory model's result (a DataFrame, or triosim.results.memory.MemoryCurves
        to build it from when asked for); `capacity` None: the GPU is not known. With
        symmetry, `memory` (MemoryCurves) and `peaks` are the representatives': each image
        gets its representative's curve (the same arrays, not a copy)."""
        if self._orbits is None:
            self._memory = memory
            self.peak_memory = dict(peaks)
        else:
            rep_of = self._rep_of()
            self._memory = memory.expanded(self.gpus, rep_of)
            self.peak_memory = {g: peaks[rep_of[g]] for g in self.gpus}
        self.memory_capacity = None if capacity is None else capacity - reserve

    def out_of_memory(self) -> list | None:
        """GPUs whose peak exceeds their usable memory; None when the capacity is unknown."""
        if self.memory_capacity is None:
            return None
        return [g for g, p in self.peak_memory.items() if p > self.memory_capacity]

    # -- breakdowns ----------------------------------------------------------------------------
    def per_gpu(self) -> pd.DataFrame:
        """Per GPU: compute, communication, exposed (not overlapped) communication, idle."""
        if self._per_gpu is None:
            self._per_gpu = self._breakdown()
        return self._per_gpu.copy()

    def _breakdown(self) -> pd.DataFrame:
        """Over the last (steady-state) iteration's tasks."""
        out = []
        # with symmetry: the representatives' rows, copied to their images
        if self._log is not None:
            gpus, start, end, is_comp, is_comm = self._log.busy(len(self.iteration_times) - 1)
            # (a Series keeps a tuple GPU whole, where numpy would make it a row)
            codes, uniques = pd.factorize(pd.Series(gpus, dtype=object), sort=False)
        else:
            tl = self.own_timeline
            last = (tl["iteration"] == len(self.iteration_times) - 1).to_numpy(bool)
            # one sort by (gpu, start) for all GPUs, then a slice per GPU (no pandas per
            # GPU); the order of equal starts does not change a union's length. Numpy
            # columns: a pandas row selection would copy every column, strings included
            codes, uniques = pd.factorize(tl["gpu"].to_numpy()[last], sort=False)
            start, end = tl["start"].to_numpy(float)[last], tl["end"].to_numpy(float)[last]
            is_comp = (tl["kind"] == "compute").to_numpy(bool)[last]
            is_comm = (tl["kind"] == "comm").to_numpy(bool)[last]
        where = {g: k for k, g in enumerate(uniques)}

        def unions(mask):  # per GPU code: the union of its intervals' lengths
            return union_lengths(codes[mask], start[mask], end[mask], len(uniques)).tolist()

        comp_u, comm_u, both_u = unions(is_comp), unions(is_comm), unions(is_comp | is_comm)
        rep_of = self._rep_of() if self._orbits is not None else {}
        for g in self.gpus:
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
                    "idle": max(self.iteration_time - both, 0.0),
                }
            )
        return pd.DataFrame(out).set_index("gpu")

    def per_layer(self) -> pd.DataFrame:
        """Per GPU and layer, over the last (steady-state) iteration's tasks: one row per
        (gpu, layer) with columns gpu, layer, compute, comm (seconds of that GPU's tasks of
        the layer; "(none)" for tasks of no layer). GPUs in order, layers in the order the
        GPU first ran them; a pipeline stage's layers appear on its own GPUs only."""
        tl = self.timeline
        d = tl[
            (tl["iteration"] == len(self.iteration_times) - 1)
            & tl["kind"].isin(["compute", "comm"])
        ]
        d = d.assign(
            duration=d["end"] - d["start"],
            layer=_renamed(d["layer"], "", "(none)"),
            order=d["gpu"].map({g: i for i, g in enumerate(self.gpus)}),
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

    def per_link(self) -> pd.DataFrame:
        """Per link direction: src, dst, bandwidth, latency, nbytes, busy_time, utilisation
        (busy share of the whole run)."""
        return self.links.copy()

    def transfers(self) -> pd.DataFrame:
        """One row per transfer: src, dst, nbytes, start, end, tag."""
        return self._transfer_table().copy()

    def _transfer_table(self) -> pd.DataFrame:
        """The transfers, built from the network's group records on first use (millions
        of rows in a large hybrid run that few callers read)."""
        if callable(self._transfers):
            self._transfers = self._transfers()
        return self._transfers

    def __getstate__(self) -> dict:
        # the transfers' builder holds the network's live records, and the log the runtime's
        # blocks: pickled as the tables they build
        self._transfer_table()
        self.own_timeline  # noqa: B018 (builds it)
        return self.__dict__

    # -- reports -------------------------------------------------------------------------------
    def summary_dict(self) -> dict:
        g = self.per_gpu()
        c = self.config
        return {
            "mode": c.parallelism.mode if c else None,
            "num_gpus": len(self.gpus),
            "iterations": len(self.iteration_times),
            "iteration_time_ms": self.iteration_time * 1e3,
            "first_iteration_time_ms": self.first_iteration_time * 1e3,
            "compute_ms_mean": float(g["compute"].mean()) * 1e3,
            "comm_ms_mean": float(g["comm"].mean()) * 1e3,
            "exposed_comm_ms_mean": float(g["exposed_comm"].mean()) * 1e3,
            "idle_ms_mean": float(g["idle"].mean()) * 1e3,
            "bytes_moved": self.bytes_delivered,
            "peak_memory_gb_max": max(self.peak_memory.values(), default=0.0) / 1e9,
            "memory_capacity_gb": None
            if self.memory_capacity is None
            else self.memory_capacity / 1e9,
            "fits_in_memory": None if self.out_of_memory() is None else not self.out_of_memory(),
            "collective_bytes": self.collective_bytes,
            "simulation_wall_s": self.wall_time,
            "symmetry": self.symmetry,
        }

    def summary(self) -> str:
        s = self.summary_dict()
        rows = [
            ("mode", s["mode"]),
            ("GPUs", s["num_gpus"]),
            *(
                [
                    ("iterations", s["iterations"]),
                    ("iteration time (steady state)", f"{s['iteration_time_ms']:.4f} ms"),
                    ("first iteration", f"{s['first_iteration_time_ms']:.4f} ms"),
                ]
                if s["iterations"] > 1
                else [("iteration time", f"{s['iteration_time_ms']:.4f} ms")]
            ),
            ("compute / GPU (mean)", f"{s['compute_ms_mean']:.4f} ms"),
            ("communication / GPU (mean)", f"{s['comm_ms_mean']:.4f} ms"),
            ("exposed communication (mean)", f"{s['exposed_comm_ms_mean']:.4f} ms"),
            ("idle / GPU (mean)", f"{s['idle_ms_mean']:.4f} ms"),
            ("bytes moved", f"{s['bytes_moved'] / 1e6:.3f} MB"),
            ("peak memory / GPU (max)", f"{s['peak_memory_gb_max']:.3f} GB"),
            ("fits in memory", self._verdict()),
            ("simulated in", f"{s['simulation_wall_s']:.3f} s wall"),
            *([("symmetry", s["symmetry"])] if s["symmetry"] != "off" else []),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)

    def _verdict(self) -> str:
        oom = self.out_of_memory()
        if oom is None:
            return "unknown (the GPU's capacity is not in the catalogue)"
        cap = f"{self.memory_capacity / 1e9:.3f} GB usable"
        if not oom:
            return f"yes ({cap})"
        return f"NO: OUT OF MEMORY on {len(oom)} GPU(s), e.g. GPU {oom[0]} ({cap})"

    # -- exports -------------------------------------------------------------------------------
    def to_chrome_trace(self, path) -> Path:
        """Chrome trace-event JSON (open in https://ui.perfetto.dev). One process per GPU
        with one thread per stream (compute, comm, ...), and a "network" process with one
        thread per source -> destination GPU direction holding its transfers (end to end:
        the links a transfer crossed are not recorded; links.csv has per-link totals).
        Thread ids are integers; each thread is named by a thread_name metadata event."""
        events = []
        pid_of = {g: i for i, g in enumerate(self.gpus)}
        tl = self.timeline[self.timeline["kind"] != "wait"]
        tid_of: dict = {}  # (gpu, stream) -> integer thread id within the GPU's process
        count: dict = {}
        for g, s in dict.fromkeys(zip(self.timeline["gpu"], self.timeline["stream"], strict=True)):
            tid_of[g, s] = count[g] = count.get(g, -1) + 1
        for pid, g in enumerate(self.gpus):
            events.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": pid,
                    "tid": 0,
                    "args": {"name": f"GPU {g}"},
                }
            )
            events.append(
                {
                    "ph": "M",
                    "name": "process_sort_index",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": pid},
                }
            )
        for (g, s), tid in tid_of.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid_of[g],
                    "tid": tid,
                    "args": {"name": f"{s} stream"},
                }
            )
        for r in tl.itertuples(index=False):
            events.append(
                {
                    "ph": "X",
                    "name": r.name,
                    "cat": r.kind,
                    "pid": pid_of[r.gpu],
                    "tid": tid_of[r.gpu, r.stream],
                    "ts": r.start * 1e6,
                    "dur": (r.end - r.start) * 1e6,
                    "args": {
                        "layer": r.layer,
                        "phase": r.phase,
                        "nbytes": r.nbytes,
                        "iteration": r.iteration,
                    },
                }
            )
        net_pid = len(self.gpus)
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": net_pid,
                "tid": 0,
                "args": {"name": "network (transfers per source -> destination)"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": net_pid,
                "tid": 0,
                "args": {"sort_index": net_pid},
            }
        )
        pair_tid: dict = {}
        for r in self._transfer_table().itertuples(index=False):
            tid = pair_tid.get((r.src, r.dst))
            if tid is None:
                tid = pair_tid[r.src, r.dst] = len(pair_tid)
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": net_pid,
                        "tid": tid,
                        "args": {"name": f"GPU {r.src} -> GPU {r.dst}"},
                    }
                )
            events.append(
                {
                    "ph": "X",
                    "name": r.tag or "transfer",
                    "cat": "transfer",
                    "pid": net_pid,
                    "tid": tid,
                    "ts": r.start * 1e6,
                    "dur": (r.end - r.start) * 1e6,
                    "args": {"nbytes": r.nbytes},
                }
            )
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    # -- figures (triosim.results.plots) ---------------------------------------------------------------
    def _title(self) -> str:
        mode = self.config.parallelism.mode if self.config else ""
        return f"{mode}, {len(self.gpus)} GPUs: iteration {self.iteration_time * 1e3:.3f} ms"

    def topology_layout(self) -> dict:
        """What the link figure needs of the topology: kind, and rows/cols of a grid."""
        if self.config is None:
            return {}
        t = self.config.topology
        return {
            "kind": t.kind,
            "rows": getattr(t.options, "rows", None),
            "cols": getattr(t.options, "cols", None),
        }

    def plot_timeline(self, path, max_gpus: int = 16) -> Path:
        """Per-GPU timeline PNG: every GPU up to `max_gpus`, else a sample the title names."""
        from triosim.results import plots

        return plots.plot_timeline(self.timeline, self.gpus, self._title(), path, max_gpus)

    def plot_breakdown(self, path) -> Path:
        """Per-GPU compute / exposed communication / idle, stacked (PNG)."""
        from triosim.results import plots

        return plots.plot_breakdown(self.per_gpu(), self.iteration_time, self._title(), path)

    def plot_links(self, path) -> Path:
        """Per-link-direction utilisation (PNG): drawn on the topology for rings, meshes and
        tori, the busiest link directions as bars otherwise."""
        from triosim.results import plots

        return plots.plot_links(self.links, self.gpus, self.topology_layout(), self._title(), path)

    def plot_memory(self, path, max_gpus: int = 4) -> Path:
        """Stacked memory over time for the first `max_gpus` GPUs (the peak GPU among them)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from triosim.results.memory import CATEGORIES

        peak_gpu = max(self.peak_memory, key=self.peak_memory.get) if self.peak_memory else None
        gpus = list(dict.fromkeys([peak_gpu, *self.gpus[:max_gpus]]))[:max_gpus]
        fig, axes = plt.subplots(
            len(gpus), 1, figsize=(9, 1.2 + 1.8 * len(gpus)), sharex=True, squeeze=False
        )
        for ax, g in zip(axes[:, 0], gpus, strict=True):
            d = self.memory[self.memory["gpu"] == g]
            ax.stackplot(
                d["time"] * 1e3,
                *[d[c] / 1e9 for c in CATEGORIES],
                step="post",
                labels=[c.replace("_", " ") for c in CATEGORIES],
            )
            if (
                self.memory_capacity is not None
                and self.peak_memory.get(g, 0) > 0.5 * self.memory_capacity
            ):
                ax.axhline(self.memory_capacity / 1e9, color="red", ls="--", lw=1, label="usable")
            ax.set_ylabel(f"GPU {g}\nGB")
        axes[0, 0].legend(loc="upper left", fontsize=7, ncol=3)
        axes[-1, 0].set_xlabel("time (ms)")
        axes[0, 0].set_title(
            f"memory per GPU (peak {max(self.peak_memory.values(), default=0) / 1e9:.3f} GB; "
            f"fits: {self._verdict()})",
            fontsize=9,
        )
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    # every file `save` may write into a folder (with --force, what an earlier run left goes)
    OUTPUTS = (
        "timeline.csv",
        "per_gpu.csv",
        "per_layer.csv",
        "links.csv",
        "summary.json",
        "chrome_trace.json",
        "timeline.png",
        "memory.csv",
        "memory.png",
        "config.yaml",
        "trace.json.gz",
    )

    def save(self, folder) -> Path:
        """Write every output (CSV, JSON, Chrome trace, PNG, the config) into `folder`, each
        file whole (written beside, then renamed), and list them in the folder's manifest
        (triosim.common.outputs). summary.json records the CSV tables' row counts under `rows`, so
        that a table cut short later is noticed when it is read back."""
        from triosim.common.outputs import note_written, replacing

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []

        def put(name, write):
            with replacing(folder / name) as tmp:
                write(tmp)
            written.append(name)

        tables = {
            "timeline.csv": (self.timeline, False),
            "per_gpu.csv": (self.per_gpu(), True),
            "per_layer.csv": (self.per_layer(), False),
            "links.csv": (self.per_link(), False),
        }
        if len(self._memory):
            tables["memory.csv"] = (self.memory, False)
        try:
            for name, (df, index) in tables.items():
                put(name, lambda p, df=df, index=index: df.to_csv(p, index=index))
            summary = {**self.summary_dict(), "rows": {n: len(df) for n, (df, _) in tables.items()}}
            put("summary.json", lambda p: p.write_text(json.dumps(summary, indent=2)))
            put("chrome_trace.json", self.to_chrome_trace)
            put("timeline.png", self.plot_timeline)
            if len(self._memory):
                put("memory.png", self.plot_memory)
            if self.config is not None:
                config = self.config
                if self.trace is not None:  # a trace passed in memory: keep it beside the config
                    from triosim.trace.model import save as save_trace

                    put("trace.json.gz", lambda p: save_trace(self.trace, p))
                    config = dataclasses.replace(
                        config, trace=str((folder / "trace.json.gz").resolve())
                    )
                put("config.yaml", config.save)
        finally:
            note_written(folder, written, "simulate")
        return folder
