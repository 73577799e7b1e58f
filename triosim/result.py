"""What a run returns: iteration time, timeline and breakdowns as DataFrames, and exports.

Times are seconds and sizes bytes in every DataFrame; `summary()` and the CLI print ms.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd

from extrapolators.runtime import COLUMNS
from triosim.intervals import union_length


def _intervals(df):
    return df["start"].to_numpy(), df["end"].to_numpy()


class Result:
    """A plain record of one run: picklable, holding no live simulation objects.

    `timeline` has one row per task (COLUMNS); `per_link()` one row per link direction
    with the same columns for every network; `config` is the resolved Config.
    """

    def __init__(self, rows, gpus, config, links, transfers, collective_bytes,
                 bytes_delivered, network_stats, wall_time, trace=None):  # fmt: skip
        self.timeline = pd.DataFrame(rows, columns=list(COLUMNS))
        self.gpus = list(gpus)
        self.config = config
        tl = self.timeline
        ends = tl.groupby("iteration")["end"].max().sort_index() if len(tl) else pd.Series([0.0])
        # iteration k ends when its last task does; its time is measured from the end of k-1
        self.iteration_ends = [float(x) for x in ends]
        starts = [0.0, *self.iteration_ends[:-1]]
        self.iteration_times = [b - a for a, b in zip(starts, self.iteration_ends, strict=True)]
        self.first_iteration_time = self.iteration_times[0]
        self.iteration_time = self.iteration_times[-1]  # the steady state when iterations > 1
        self.total_time = self.iteration_ends[-1]
        links = links.copy()
        links["utilisation"] = links["busy_time"] / self.total_time if self.total_time else 0.0
        self.links = links
        self._transfers = transfers
        self.collective_bytes = dict(collective_bytes)
        self.bytes_delivered = float(bytes_delivered)
        self.network_stats = dict(network_stats)
        self.wall_time = wall_time
        self.trace = trace  # only for a trace passed in memory: saved beside the config
        self._per_gpu = None  # the timeline is final: compute the breakdown once
        self.memory = pd.DataFrame()  # gpu, time, bytes per category and total
        self.peak_memory: dict = {}  # GPU -> peak bytes
        self.memory_capacity: float | None = None  # bytes usable by tensors (after reserve)

    def set_memory(self, memory, peaks: dict, capacity: float | None, reserve: float) -> None:
        """Attach the memory model's result; `capacity` None: the GPU is not known."""
        self.memory = memory
        self.peak_memory = dict(peaks)
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
        last = self.timeline[self.timeline["iteration"] == len(self.iteration_times) - 1]
        groups = dict(tuple(last.groupby("gpu", sort=False)))
        empty = last.iloc[:0]
        for g in self.gpus:
            d = groups.get(g, empty)
            comp = d[d["kind"] == "compute"]
            comm = d[d["kind"] == "comm"]
            c = union_length(*_intervals(comp))
            m = union_length(*_intervals(comm))
            both = union_length(*_intervals(pd.concat([comp, comm])))
            out.append({"gpu": g, "compute": c, "comm": m, "exposed_comm": both - c,
                        "idle": max(self.iteration_time - both, 0.0)})  # fmt: skip
        return pd.DataFrame(out).set_index("gpu")

    def per_layer(self) -> pd.DataFrame:
        """Per layer: compute and communication seconds, averaged over GPUs."""
        d = self.timeline[self.timeline["kind"].isin(["compute", "comm"])]
        d = d.assign(duration=d["end"] - d["start"], layer=d["layer"].replace("", "(none)"))
        table = d.pivot_table(index="layer", columns="kind", values="duration", aggfunc="sum",
                              fill_value=0.0, sort=False)  # fmt: skip
        for k in ("compute", "comm"):
            if k not in table:
                table[k] = 0.0
        return table[["compute", "comm"]] / max(len(self.gpus), 1)

    def per_link(self) -> pd.DataFrame:
        """Per link direction: bandwidth, latency, bytes, busy time, utilisation (busy share
        of the iteration)."""
        return self.links.copy()

    def transfers(self) -> pd.DataFrame:
        """One row per transfer: src, dst, nbytes, start, end, tag."""
        return self._transfers.copy()

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
        """Chrome trace-event JSON (open in https://ui.perfetto.dev): a track per GPU stream,
        and one per network link direction for the transfers."""
        events = []
        for pid, g in enumerate(self.gpus):
            events.append(
                {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"GPU {g}"}}
            )
        pid_of = {g: i for i, g in enumerate(self.gpus)}
        tl = self.timeline[self.timeline["kind"] != "wait"]
        for r in tl.itertuples(index=False):
            events.append({"ph": "X", "name": r.name, "cat": r.kind, "pid": pid_of[r.gpu],
                           "tid": r.stream, "ts": r.start * 1e6, "dur": (r.end - r.start) * 1e6,
                           "args": {"layer": r.layer, "phase": r.phase, "bytes": r.nbytes}})  # fmt: skip
        net_pid = len(self.gpus)
        events.append(
            {"ph": "M", "name": "process_name", "pid": net_pid, "args": {"name": "network"}}
        )
        for r in self._transfers.itertuples(index=False):
            events.append({"ph": "X", "name": r.tag or "transfer", "cat": "transfer", "pid": net_pid,
                           "tid": f"{r.src}->{r.dst}", "ts": r.start * 1e6,
                           "dur": (r.end - r.start) * 1e6, "args": {"bytes": r.nbytes}})  # fmt: skip
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def plot_timeline(self, path, max_gpus: int = 16) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        gpus = self.gpus[:max_gpus]
        fig, ax = plt.subplots(figsize=(12, 0.5 + 0.6 * len(gpus)))
        colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
        for y, g in enumerate(gpus):
            d = self.timeline[(self.timeline["gpu"] == g) & (self.timeline["kind"] != "wait")]
            for kind, off in (("compute", 0.0), ("comm", 0.4)):
                k = d[d["kind"] == kind]
                cols = [
                    colors.get(p, "grey") if kind == "compute" else "tab:red" for p in k["phase"]
                ]
                ax.broken_barh(list(zip(k["start"] * 1e3, (k["end"] - k["start"]) * 1e3, strict=True)),
                               (y + off, 0.35), facecolors=cols)  # fmt: skip
        ax.set_yticks([y + 0.4 for y in range(len(gpus))], [f"GPU {g}" for g in gpus])
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{self.config.parallelism.mode if self.config else ''}: "
                     f"iteration {self.iteration_time * 1e3:.3f} ms "
                     "(blue fwd, orange bwd, green optimizer, red communication)")  # fmt: skip
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def plot_memory(self, path, max_gpus: int = 4) -> Path:
        """Stacked memory over time for the first `max_gpus` GPUs (the peak GPU among them)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from triosim.memory import CATEGORIES

        peak_gpu = max(self.peak_memory, key=self.peak_memory.get) if self.peak_memory else None
        gpus = list(dict.fromkeys([peak_gpu, *self.gpus[:max_gpus]]))[:max_gpus]
        fig, axes = plt.subplots(len(gpus), 1, figsize=(9, 1.2 + 1.8 * len(gpus)), sharex=True,
                                 squeeze=False)  # fmt: skip
        for ax, g in zip(axes[:, 0], gpus, strict=True):
            d = self.memory[self.memory["gpu"] == g]
            ax.stackplot(d["time"] * 1e3, *[d[c] / 1e9 for c in CATEGORIES], step="post",
                         labels=[c.replace("_", " ") for c in CATEGORIES])  # fmt: skip
            if (
                self.memory_capacity is not None
                and self.peak_memory.get(g, 0) > 0.5 * self.memory_capacity
            ):
                ax.axhline(self.memory_capacity / 1e9, color="red", ls="--", lw=1, label="usable")
            ax.set_ylabel(f"GPU {g}\nGB")
        axes[0, 0].legend(loc="upper left", fontsize=7, ncol=3)
        axes[-1, 0].set_xlabel("time (ms)")
        axes[0, 0].set_title(f"memory per GPU (peak {max(self.peak_memory.values(), default=0) / 1e9:.3f} GB; "
                             f"fits: {self._verdict()})", fontsize=9)  # fmt: skip
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def save(self, folder) -> Path:
        """Write every output (CSV, JSON, Chrome trace, PNG, the config) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.timeline.to_csv(folder / "timeline.csv", index=False)
        self.per_gpu().to_csv(folder / "per_gpu.csv")
        self.per_layer().to_csv(folder / "per_layer.csv")
        self.per_link().to_csv(folder / "links.csv", index=False)
        (folder / "summary.json").write_text(json.dumps(self.summary_dict(), indent=2))
        self.to_chrome_trace(folder / "chrome_trace.json")
        self.plot_timeline(folder / "timeline.png")
        if len(self.memory):
            self.memory.to_csv(folder / "memory.csv", index=False)
            self.plot_memory(folder / "memory.png")
        if self.config is not None:
            config = self.config
            if self.trace is not None:  # a trace passed in memory: keep it beside the config
                from triosim.trace import save as save_trace

                save_trace(self.trace, folder / "trace.json.gz")
                config = dataclasses.replace(
                    config, trace=str((folder / "trace.json.gz").resolve())
                )
            config.save(folder / "config.yaml")
        return folder
