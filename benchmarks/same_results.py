"""Whether a change kept every result: a fixed set of configs, each run and fingerprinted.

For a refactor that must change no result (moving modules, splitting classes, reformatting):
run it on the commit before and after and compare. Each row is a config (every example,
every parallelism mode on the shipped CPU traces, the packet and the photonic network,
`symmetry` off and auto, the NCCL and textbook communication models) with its iteration
time (repr: every digit), a SHA-256 of its whole timeline table (every row and column,
floats as repr) and one of its work (the compute and communication rows, sorted, without
the stream names and meeting keys), so two runs agree only if every task of every GPU
starts and ends at the same instant; a refactor that regroups the streams (other stream
names, keys, waits) keeps the work and is said to. Each row also has a SHA-256 of the
memory model's curves and peaks (every GPU's, floats bit for bit) and one of the other
outputs (the summary without its wall time, the network's counters, every link's totals
and every transfer); a fingerprint file written before a field existed is compared on the
rest.

Run: PYTHONPATH=. python -m benchmarks.same_results [--out before.json] [--against before.json]
(--against exits 1 when any row differs and prints the rows that do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESNET = str(ROOT / "traces" / "cpu" / "resnet18-b8.trace.json.gz")
GPT2 = str(ROOT / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz")
RING = {"kind": "ring", "bandwidth": "65 GB/s", "latency": "1 us"}
MODES = [
    ("single", {"mode": "single"}, 1, RESNET),
    ("dp", {"mode": "dp"}, 4, RESNET),
    ("ddp", {"mode": "ddp"}, 4, RESNET),
    ("fsdp", {"mode": "fsdp"}, 4, GPT2),
    ("tp", {"mode": "tp"}, 4, GPT2),
    ("tp-sequence", {"mode": "tp", "sequence_parallel": True}, 4, GPT2),
    ("gpipe", {"mode": "gpipe", "microbatches": 4}, 4, RESNET),
    ("1f1b", {"mode": "1f1b", "microbatches": 4}, 4, RESNET),
    ("hybrid", {"mode": "hybrid", "dp": 2, "inner": "gpipe", "microbatches": 2}, 4, RESNET),
    ("3d", {"mode": "3d", "dp": 2, "tp": 2, "pp": 2, "microbatches": 2}, 8, GPT2),
    (
        "interleaved",
        {"mode": "interleaved", "dp": 1, "tp": 1, "pp": 2, "microbatches": 4, "virtual_stages": 2},
        2,
        GPT2,
    ),
    ("hop", {"mode": "hop"}, 4, RESNET),
]
# the LLM layouts (shape-only H100 traces: Llama 3 8B, Mixtral 8x7B), textbook collectives
# and the NCCL model, symmetry off: every option of the modes that compose dimensions
MODELLED = ROOT / "traces" / "modelled" / "h100-sxm"
LLAMA = str(MODELLED / "llama3-8b-s2048-b8.trace.json.gz")
MIXTRAL = str(MODELLED / "mixtral-8x7b-s4096-b1.trace.json.gz")
NODES = {
    "kind": "multi_node",
    "gpus_per_node": 4,
    "bandwidth": "450 GB/s",
    "latency": "1 us",
    "inter_bandwidth": "50 GB/s",
    "inter_latency": "5 us",
}
LLM = [
    ("llama fsdp", {"mode": "fsdp", "wrap_depth": 2}, 4, LLAMA, 8),
    ("llama fsdp recompute", {"mode": "fsdp", "wrap_depth": 2, "recompute": "full"}, 4, LLAMA, 8),
    ("gpt2 zero1", {"mode": "fsdp", "stage": 1}, 4, GPT2, 8),
    ("gpt2 zero2", {"mode": "fsdp", "stage": 2, "bucket_size": 2**20}, 4, GPT2, 8),
    ("gpt2 fsdp keep", {"mode": "fsdp", "reshard_after_forward": False}, 4, GPT2, 8),
    ("gpt2 dp acc", {"mode": "dp", "accumulation_steps": 2, "recompute": "selective"}, 2, GPT2, 8),
    ("gpt2 ddp full", {"mode": "ddp", "recompute": "full", "recompute_depth": 3}, 2, GPT2, 8),
    ("resnet tp channel", {"mode": "tp", "tp_style": "channel"}, 2, RESNET, 8),
    (
        "resnet gpipe except_last",
        {"mode": "gpipe", "microbatches": 4, "recompute": "except_last"},
        2,
        RESNET,
        8,
    ),
    ("resnet 1f1b stages", {"mode": "1f1b", "microbatches": 2, "stages": ["layer3"]}, 2, RESNET, 8),
    ("gpt2 hybrid tp", {"mode": "hybrid", "dp": 2, "inner": "tp"}, 4, GPT2, 8),
    ("llama cp", {"mode": "cp", "cp": 2}, 4, LLAMA, 8),
    (
        "llama cp a2a tp",
        {"mode": "cp", "cp": 2, "tp": 2, "cp_comm": "a2a", "sequence_parallel": True},
        8,
        LLAMA,
        8,
    ),
    ("llama cp fsdp", {"mode": "cp", "cp": 2, "fsdp": True, "wrap_depth": 2}, 4, LLAMA, 8),
    ("llama cp1 fsdp", {"mode": "cp", "cp": 1, "fsdp": True, "wrap_depth": 2}, 4, LLAMA, 8),
    (
        "llama cp distopt",
        {"mode": "cp", "cp": 2, "tp": 2, "distributed_optimizer": True, "accumulation_steps": 2},
        8,
        LLAMA,
        8,
    ),
    (
        "llama 3d cp",
        {"mode": "3d", "dp": 1, "tp": 2, "pp": 2, "cp": 2, "microbatches": 2},
        8,
        LLAMA,
        8,
    ),
    (
        "llama 3d distopt",
        {
            "mode": "3d",
            "dp": 2,
            "tp": 2,
            "pp": 2,
            "microbatches": 2,
            "distributed_optimizer": True,
            "sequence_parallel": True,
        },
        8,
        LLAMA,
        8,
    ),
    (
        "llama 3d no overlap",
        {
            "mode": "3d",
            "dp": 2,
            "tp": 1,
            "pp": 2,
            "microbatches": 4,
            "dp_overlap": False,
            "placement": "dp-pp-tp",
        },
        4,
        LLAMA,
        8,
    ),
    (
        "llama interleaved",
        {"mode": "interleaved", "dp": 1, "tp": 2, "pp": 2, "microbatches": 4},
        4,
        LLAMA,
        8,
    ),
    ("mixtral ep", {"mode": "ep", "ep": 4, "dp_overlap": True}, 8, MIXTRAL, 8),
    ("mixtral ep tp", {"mode": "ep", "ep": 4, "tp": 2, "accumulation_steps": 2}, 8, MIXTRAL, 8),
    (
        "mixtral ep etp",
        {"mode": "ep", "ep": 2, "etp": 2, "tp": 2, "distributed_optimizer": True},
        8,
        MIXTRAL,
        8,
    ),
    (
        "mixtral ep pp",
        {"mode": "ep", "ep": 2, "pp": 2, "accumulation_steps": 4, "dp_overlap": True},
        8,
        MIXTRAL,
        16,
    ),
    (
        "mixtral ep interleaved",
        {
            "mode": "ep",
            "ep": 4,
            "pp": 2,
            "accumulation_steps": 2,
            "schedule": "interleaved",
            "virtual_stages": 2,
            "distributed_optimizer": True,
            "overlap_param_gather": True,
        },
        8,
        MIXTRAL,
        8,
    ),
    ("mixtral ep fsdp", {"mode": "ep", "ep": 4, "fsdp": True, "wrap_depth": 2}, 8, MIXTRAL, 8),
    (
        "mixtral ep skew",
        {"mode": "ep", "ep": 8, "load": "skew", "skew": 1.2, "capacity_factor": 1.25},
        8,
        MIXTRAL,
        8,
    ),
]


def configs() -> dict:
    """name -> config (a path or a mapping)."""
    # every example but the published layouts of hundreds of GPUs (their whole timelines run
    # to gigabytes; benchmarks/mesh_layouts.py runs them)
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    out: dict = {
        f"example {p.stem}": str(p)
        for p in examples
        if not p.stem.startswith(("titan_", "megatron_"))
    }
    for name, par, n, trace in MODES:
        for comm in ("nccl", "textbook"):
            for sym in ("off", "auto"):
                cfg = {
                    "trace": trace,
                    "num_gpus": n,
                    "batch_size": 8,
                    "parallelism": par,
                    "topology": RING,
                    "communication": {"kind": comm},
                    "symmetry": sym,
                }
                out[f"{name} {comm} symmetry {sym}"] = cfg
    for name, par, n, trace, batch in LLM:
        for comm in ("nccl", "textbook"):
            out[f"{name} {comm}"] = {
                "trace": trace,
                "num_gpus": n,
                "batch_size": batch,
                "parallelism": par,
                "topology": {**NODES, "gpus_per_node": min(n, 4)},
                "communication": {"kind": comm},
                "perfmodel": {"kind": "calibrated"} if trace in (LLAMA, MIXTRAL) else {},
            }
    out["ddp photonic"] = {
        "trace": RESNET,
        "num_gpus": 4,
        "batch_size": 8,
        "parallelism": {"mode": "ddp"},
        "topology": RING,
        "network": {"kind": "photonic", "setup_time": "20 us"},
    }
    out["ddp fat tree, 3 iterations"] = {
        "trace": RESNET,
        "num_gpus": 16,
        "batch_size": 16,
        "iterations": 3,
        "parallelism": {"mode": "ddp"},
        "topology": {"kind": "fat_tree", "radix": 8, "bandwidth": "50 GB/s"},
    }
    return out


# what ran and when, whatever the streams and meeting keys are called: the compute and
# communication rows (not the waits, which follow how the work is split into streams)
WORK_COLUMNS = ["gpu", "kind", "name", "layer", "phase", "start", "end", "nbytes", "iteration"]
WORK_COLUMNS += ["op_id", "microbatch"]


def fingerprint(cfg) -> dict:
    from triosim.simulation.wiring import Simulation

    r = Simulation(cfg).run()
    tl = r.timeline
    table = tl.to_csv(index=False, float_format="%r")
    work = tl[tl["kind"] != "wait"][WORK_COLUMNS].astype(str)
    work = work.sort_values(WORK_COLUMNS).to_csv(index=False)
    return {
        "iteration_time": repr(r.iteration_time),
        "timeline_sha256": hashlib.sha256(table.encode()).hexdigest(),
        "work_sha256": hashlib.sha256(work.encode()).hexdigest(),
        "memory_sha256": _memory_sha256(r),
        "outputs_sha256": _outputs_sha256(r),
        "rows": len(tl),
    }


def _outputs_sha256(r) -> str:
    """Of the run's other outputs: its summary (without the wall time), the network's
    counters, every link's totals and every transfer."""
    import pandas as pd

    summary = {k: v for k, v in r.summary_dict().items() if k != "simulation_wall_s"}
    h = hashlib.sha256(repr(sorted(summary.items(), key=str)).encode())
    h.update(repr(sorted(r.network_stats.items(), key=str)).encode())
    # (pandas' hash of each value: -0.0 hashes as 0.0, and another pandas version may hash
    # otherwise, so a baseline and its comparison are written in one environment)
    for table in (r.per_link(), r.transfers()):
        h.update(repr(list(table.columns)).encode())
        h.update(pd.util.hash_pandas_object(table, index=False).to_numpy().tobytes())
    return h.hexdigest()


def _memory_sha256(r) -> str:
    """Of the memory curves (gpu, time, each category, total: floats as their bits) and
    every GPU's peak (repr): "none" where the run has no memory model (no trace)."""
    import pandas as pd

    mem = r.memory
    h = hashlib.sha256()
    if mem is None or not len(mem):
        h.update(b"none")
    else:
        h.update(pd.util.hash_pandas_object(mem, index=False).to_numpy().tobytes())
    h.update(repr(sorted((str(g), repr(p)) for g, p in r.peak_memory.items())).encode())
    return h.hexdigest()


def _common(a, b) -> tuple:
    """Two fingerprints on the fields both have (a file written before a field existed);
    as they are where either is missing or an error."""
    if a is None or b is None or "error" in a or "error" in b:
        return a, b
    return {k: v for k, v in a.items() if k in b}, {k: v for k, v in b.items() if k in a}


def _renamed(a, b) -> bool:
    """Whether two fingerprints that `_same` finds alike differ at all (stream names)."""
    a, b = _common(a, b)
    return a != b


def _same(a, b) -> str | None:
    """None where two fingerprints agree; else what differs. Rows that differ only in
    stream names, meeting keys or waits (a refactor that regroups the streams) are the
    same work: said, not counted."""
    a, b = _common(a, b)
    if a == b:
        return None
    if a is None or b is None or "error" in a or "error" in b:
        return "differs"
    if a["iteration_time"] != b["iteration_time"]:
        return "iteration time differs"
    if a.get("work_sha256") != b.get("work_sha256"):
        return "work differs (compute or communication rows)"
    if a.get("memory_sha256") != b.get("memory_sha256"):
        return "memory differs (curves or peaks)"
    if a.get("outputs_sha256") != b.get("outputs_sha256"):
        return "outputs differ (summary, network counters, links or transfers)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprints to this JSON file")
    ap.add_argument("--against", help="compare with fingerprints written before")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")  # the CPU traces' missing FLOP counts, said elsewhere
    got = {}
    for name, cfg in configs().items():
        try:
            got[name] = fingerprint(cfg)
        except Exception as e:  # noqa: BLE001 (an error is a result too: it must not change)
            got[name] = {"error": f"{type(e).__name__}: {e}"}
        row = got[name]
        shown = row.get("error") or f"{row['iteration_time']:<22} {row['timeline_sha256'][:16]}"
        print(f"{name:<40} {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps(got, indent=1, sort_keys=True))
    if args.against:
        before = json.loads(Path(args.against).read_text())
        keys = sorted(set(before) | set(got))
        changed = [k for k in keys if _same(before.get(k), got.get(k))]
        renamed = [k for k in keys if k not in changed and _renamed(before.get(k), got.get(k))]
        print(f"\n{len(got) - len(changed)} of {len(got)} configs identical to {args.against}")
        if renamed:
            print(f"({len(renamed)} of them the same work under other stream names, keys or waits)")
        for k in changed:
            print(f"  {_same(before.get(k), got.get(k))}: {k}: {before.get(k)} -> {got.get(k)}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
