"""A run's summary as text: what `Result.summary()` prints (and the CLI after a run).

What a caller may rely on: `summary_text(s, verdict)` lays out the dict of
`Result.summary_dict()` as aligned "name  value" lines, times in ms, bytes in MB and GB;
`verdict(oom, capacity)` is the "fits in memory" answer, from `Result.out_of_memory()`
(None: the capacity is unknown) and `Result.memory_capacity` (bytes usable by tensors),
or `unknown`: why the run has no memory model (`Result.memory_unknown`: no trace).
A summary's `peak_memory_gb_max` is None then, printed n/a.
Both are plain functions of what they are given.
"""

from __future__ import annotations


def summary_text(s: dict, verdict: str) -> str:
    rows = [
        ("mode", s["mode"]),
        *([("mesh", s["layout"])] if s.get("layout") else []),
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
        (
            "peak memory / GPU (max)",
            "n/a" if s["peak_memory_gb_max"] is None else f"{s['peak_memory_gb_max']:.3f} GB",
        ),
        ("fits in memory", verdict),
        ("simulated in", f"{s['simulation_wall_s']:.3f} s wall"),
        *([("symmetry", s["symmetry"])] if s["symmetry"] != "off" else []),
        *([("symmetric flows", s["symmetry_flows"])] if s.get("symmetry_flows") else []),
        *([("host model", s["host"])] if "host" in s else []),
        *([("overlap", s["overlap"])] if "overlap" in s else []),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def verdict(oom: list | None, capacity: float | None, unknown: str | None = None) -> str:
    if unknown:
        return f"unknown ({unknown})"
    if oom is None:
        return "unknown (the GPU's capacity is not in the catalogue)"
    cap = f"{capacity / 1e9:.3f} GB usable"
    if not oom:
        return f"yes ({cap})"
    return f"NO: OUT OF MEMORY on {len(oom)} GPU(s), e.g. GPU {oom[0]} ({cap})"
