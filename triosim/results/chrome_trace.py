"""One run as Chrome trace-event JSON (open in https://ui.perfetto.dev).

What a caller may rely on: `write(timeline, gpus, transfers, path)` writes one file with
one process per GPU (pid = the GPU's place in `gpus`), one thread per stream of it
(compute, comm, ...; integer ids in order of first appearance in the timeline), and a
"network" process last, with one thread per source -> destination direction holding its
transfers (end to end: the links a transfer crossed are not recorded; links.csv has
per-link totals). Every thread is named by a thread_name metadata event; times are
microseconds. What it must provide: the timeline (every GPU's rows, COLUMNS; "wait" rows
are left out) and the transfer table (src, dst, nbytes, start, end, tag).
"""

from __future__ import annotations

import json
from pathlib import Path


def write(timeline, gpus, transfers, path) -> Path:
    events = _gpu_events(timeline, gpus)
    events += _network_events(transfers, len(gpus))
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def _process(pid: int, name: str) -> list:
    """A process's name and its place in the list (its pid)."""
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "ph": "M",
            "name": "process_sort_index",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]


def _gpu_events(timeline, gpus) -> list:
    """Every GPU's process and stream threads, then every task but waits."""
    events = []
    pid_of = {g: i for i, g in enumerate(gpus)}
    tl = timeline[timeline["kind"] != "wait"]
    tid_of: dict = {}  # (gpu, stream) -> integer thread id within the GPU's process
    count: dict = {}
    for g, s in dict.fromkeys(zip(timeline["gpu"], timeline["stream"], strict=True)):
        tid_of[g, s] = count[g] = count.get(g, -1) + 1
    for pid, g in enumerate(gpus):
        events += _process(pid, f"GPU {g}")
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
    return events


def _network_events(transfers, net_pid: int) -> list:
    """The network's process, a thread per direction (named when first met), its transfers."""
    events = _process(net_pid, "network (transfers per source -> destination)")
    pair_tid: dict = {}
    for r in transfers.itertuples(index=False):
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
    return events
