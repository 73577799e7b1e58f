"""What a run returns: iteration time, timeline and breakdowns as DataFrames, and exports.

Times are seconds and sizes bytes in every DataFrame; `summary()` and the CLI print ms.

`Result` holds the run's record and hands the work on, each piece a plain function of the
values it is given (none of them imports this module):
- triosim.results.symmetric: with symmetry, the images' timeline rows from their
  representatives';
- triosim.results.tables: the per-GPU and per-layer breakdowns (over
  triosim.results.unions, the interval arithmetic);
- triosim.results.report: the summary as text;
- triosim.results.chrome_trace: the Chrome trace file;
- triosim.results.plots: the figures.
`save` stays here: it is the list of what a result folder holds (`OUTPUTS`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd

from extrapolators.execution.timeline_log import COLUMNS, TimelineLog
from triosim.results import chrome_trace, report, symmetric, tables


class Result:
    """A plain record of one run: picklable, holding no live simulation objects.

    `timeline` has one row per task (COLUMNS); `per_link()` one row per link direction
    with the same columns for every network; `config` is the resolved Config.
    """

    memory_unknown: str | None = None  # (results pickled before it existed have none)

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
        self.host = "off"  # the host model (perfmodel.host): "on (its costs)" or "off (why)"
        # what overlapped communication costs compute (extrapolators.execution.contention)
        self.overlap = "free"
        self.symmetry_skew = 0.0  # largest relative gap between an image's end and its rep's
        # with symmetry, how the network moved the copies' flows: "by orbits: ..." (one flow
        # per orbit, networks.packet.quotient) or "every copy's: <why>"; None without
        self.symmetry_flows: str | None = None
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
        self._memory_own = None  # with symmetry: the representatives' MemoryCurves
        self.peak_memory: dict = {}  # GPU -> peak bytes
        self.memory_capacity: float | None = None  # bytes usable by tensors (after reserve)
        self.memory_unknown = None  # why there is no memory model (a run without a trace)

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
            self._timeline = symmetric.expand_timeline(own, self._orbits) if self._orbits else own
        return self._timeline

    @timeline.setter
    def timeline(self, value) -> None:
        """Replace the timeline (of every GPU): the classes no longer apply."""
        self._timeline = self._own = value
        self._log, self._orbits, self._per_gpu = None, None, None

    def _rep_of(self) -> dict:
        """GPU -> the GPU whose rows stand for it (itself without symmetry)."""
        return symmetric.rep_of(self.gpus, self._orbits)

    def represented_by(self) -> pd.Series:
        """Which simulated GPU stands for each GPU (index: every GPU, in order): with
        `symmetry: auto` its class's representative, whose rows its own copy; without
        symmetry, or after a fallback, the GPU itself."""
        rep = self._rep_of()
        return pd.Series(
            [rep[g] for g in self.gpus],
            index=pd.Index(self.gpus, name="gpu"),
            name="represented_by",
        )

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
        gets its representative's curve (the same arrays, not a copy). `memory` None: the
        run has no memory model (a workload without a trace): no curve, no peak, no verdict."""
        if memory is None:
            self._memory, self.peak_memory = pd.DataFrame(), {}
            self.memory_unknown = "a workload without a trace carries no tensors"
            if self.config is not None and self.config.parallelism.mode == "chakra":
                self.memory_unknown = "a Chakra workload carries no tensors"
        elif self._orbits is None:
            self._memory = memory
            self.peak_memory = dict(peaks)
        else:
            rep_of = self._rep_of()
            self._memory_own = memory  # the representatives' curves (what `save` writes)
            self._memory = memory.expanded(self.gpus, rep_of)
            self.peak_memory = {g: peaks[rep_of[g]] for g in self.gpus}
        self.memory_capacity = None if capacity is None else capacity - reserve

    def out_of_memory(self) -> list | None:
        """GPUs whose peak exceeds their usable memory; None when the capacity or the
        memory (a run without a trace) is unknown."""
        if self.memory_capacity is None or self.memory_unknown:
            return None
        return [g for g, p in self.peak_memory.items() if p > self.memory_capacity]

    # -- breakdowns ----------------------------------------------------------------------------
    def per_gpu(self) -> pd.DataFrame:
        """Per GPU: compute, communication, exposed (not overlapped) communication, idle."""
        if self._per_gpu is None:
            self._per_gpu = self._breakdown()
        return self._per_gpu.copy()

    def _breakdown(self) -> pd.DataFrame:
        """Over the last (steady-state) iteration's tasks; with symmetry, the
        representatives' rows stand for their images."""
        last = len(self.iteration_times) - 1
        if self._log is not None:
            busy = tables.busy_of_log(self._log, last)
        else:
            busy = tables.busy_of_timeline(self.own_timeline, last)
        rep_of = self._rep_of() if self._orbits is not None else {}
        return tables.per_gpu_table(busy, self.gpus, rep_of, self.iteration_time)

    def per_layer(self) -> pd.DataFrame:
        """Per GPU and layer, over the last (steady-state) iteration's tasks: one row per
        (gpu, layer) with columns gpu, layer, compute, comm (seconds of that GPU's tasks of
        the layer; "(none)" for tasks of no layer). GPUs in order, layers in the order the
        GPU first ran them; a pipeline stage's layers appear on its own GPUs only. With
        symmetry, each GPU's rows are its representative's (its timeline's are copies of
        them): made from the representatives' rows, without every GPU's timeline."""
        last = len(self.iteration_times) - 1
        if self._orbits is None:
            return tables.per_layer_table(self.timeline, self.gpus, last)
        own = tables.per_layer_table(self.own_timeline, list(self._orbits), last)
        rows = {r: own[own["gpu"] == r] for r in self._orbits}
        rep_of = self._rep_of()
        out = pd.concat([rows[rep_of[g]].assign(gpu=g) for g in self.gpus], ignore_index=True)
        return out.astype(own.dtypes.to_dict())

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
            "layout": getattr(self, "layout", None),
            "num_gpus": len(self.gpus),
            "iterations": len(self.iteration_times),
            "iteration_time_ms": self.iteration_time * 1e3,
            "first_iteration_time_ms": self.first_iteration_time * 1e3,
            "compute_ms_mean": float(g["compute"].mean()) * 1e3,
            "comm_ms_mean": float(g["comm"].mean()) * 1e3,
            "exposed_comm_ms_mean": float(g["exposed_comm"].mean()) * 1e3,
            "idle_ms_mean": float(g["idle"].mean()) * 1e3,
            "bytes_moved": self.bytes_delivered,
            "peak_memory_gb_max": None
            if self.memory_unknown
            else max(self.peak_memory.values(), default=0.0) / 1e9,
            "memory_capacity_gb": None
            if self.memory_capacity is None
            else self.memory_capacity / 1e9,
            "fits_in_memory": None if self.out_of_memory() is None else not self.out_of_memory(),
            "collective_bytes": self.collective_bytes,
            "simulation_wall_s": self.wall_time,
            "symmetry": self.symmetry,
            "symmetry_flows": getattr(self, "symmetry_flows", None),  # (results saved before it)
            "host": self.host,
            "overlap": getattr(self, "overlap", "free"),  # (results saved before it)
        }

    def summary(self) -> str:
        """The summary as aligned lines (triosim.results.report), as the CLI prints it."""
        return report.summary_text(self.summary_dict(), self._verdict())

    def _verdict(self) -> str:
        return report.verdict(self.out_of_memory(), self.memory_capacity, self.memory_unknown)

    # -- exports -------------------------------------------------------------------------------
    def to_chrome_trace(self, path) -> Path:
        """Chrome trace-event JSON (open in https://ui.perfetto.dev). One process per GPU
        with one thread per stream (compute, comm, ...), and a "network" process with one
        thread per source -> destination GPU direction holding its transfers (end to end:
        the links a transfer crossed are not recorded; links.csv has per-link totals).
        Thread ids are integers; each thread is named by a thread_name metadata event."""
        return chrome_trace.write(self.timeline, self.gpus, self._transfer_table(), path)

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
        from triosim.results import link_plots

        return link_plots.plot_links(
            self.links, self.gpus, self.topology_layout(), self._title(), path
        )

    def plot_memory(self, path, max_gpus: int = 4) -> Path:
        """Stacked memory over time for the first `max_gpus` GPUs (the peak GPU among them)."""
        from triosim.results import plots

        return plots.plot_memory(
            self.memory,
            self.gpus,
            self.peak_memory,
            self.memory_capacity,
            self._verdict(),
            path,
            max_gpus,
        )

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

        # a symmetric run: its representatives' rows (every other GPU's are copies of them,
        # gigabytes at hundreds of GPUs), and which GPU each one stands for
        from triosim.results import plots

        reps = list(self._orbits) if self._orbits is not None else None
        if reps is None:
            timeline, shown, title = self.timeline, self.gpus, self._title()
        else:
            timeline, shown = self.own_timeline, reps
            title = f"{self._title()} (representatives)"
        memory = mem_gpus = None
        if len(self._memory):
            memory, mem_gpus = (
                (self.memory, self.gpus)
                if reps is None
                else (self._memory_own.frame(), self._memory_own.gpus)
            )
        tables = {
            "timeline.csv": (timeline, False),
            "per_gpu.csv": (self.per_gpu(), True),
            "per_layer.csv": (self.per_layer(), False),
            "links.csv": (self.per_link(), False),
        }
        if memory is not None:
            tables["memory.csv"] = (memory, False)

        def transfers():  # a symmetric run's trace: no network (every copy's transfers)
            if reps is None:
                return self._transfer_table()
            return pd.DataFrame(columns=["src", "dst", "nbytes", "start", "end", "tag"])

        try:
            for name, (df, index) in tables.items():
                put(name, lambda p, df=df, index=index: df.to_csv(p, index=index))
            summary = {**self.summary_dict(), "rows": {n: len(df) for n, (df, _) in tables.items()}}
            if reps is not None:
                summary["saved_rows"] = "representatives"
                summary["represented_by"] = {str(g): r for g, r in self._rep_of().items()}
            put("summary.json", lambda p: p.write_text(json.dumps(summary, indent=2)))
            put("chrome_trace.json", lambda p: chrome_trace.write(timeline, shown, transfers(), p))
            put("timeline.png", lambda p: plots.plot_timeline(timeline, shown, title, p))
            if memory is not None:
                peaks = self.peak_memory  # (a symmetric run's: its representatives')
                if reps is not None:
                    peaks = {g: peaks[g] for g in mem_gpus}
                verdict = self._verdict()
                put(
                    "memory.png",
                    lambda p: plots.plot_memory(
                        memory, mem_gpus, peaks, self.memory_capacity, verdict, p
                    ),
                )
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
