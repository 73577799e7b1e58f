"""How many GPU kernels an operator launches, from the real GPU traces: what a shape-only
trace records for the host model (perfmodel/host.py charges a launch per kernel).

A shape-only run (meta tensors on the CPU) launches no kernel; the tracer counts the leaves
of each operator's call tree instead, which is not what a GPU runs: a convolution is one
leaf and two to four cuDNN kernels, a transformer's GELU or softmax several leaves and one
kernel, an optimizer's item() on a CPU step count a leaf and no kernel, a foreach update one
leaf and a launch per chunk of tensors. Against the real H100 traces of the same models,
the leaf counts were +22 to +130 % off (ResNet-50 b64 981 vs 804, GPT-2 b8 1,460 vs 641).

The table: for each (phase, operator name) in the shipped real H100 traces (traces/h100 and
its imported profiles), the median kernel count of its operators (the lower median: a
count that occurred). A shape-only trace's operator of a name in the table takes that count,
any other keeps its leaf count. Kernel counts follow the CUDA libraries' choices (cuDNN's
algorithm for a shape), not a GPU's speed: the same table serves every GPU, an assumption
the modelled trace's metadata states. Fitted on some models, checked on others
(tests/test_kernel_counts.py: each model's counts from a table without it).
Regenerate: python -m perfmodel.kernel_counts; then give the shipped shape-only traces its
counts: python -m perfmodel.kernel_counts --recount traces/modelled/*/*.trace.json.gz
"""

from __future__ import annotations

import functools
import json
import statistics
from collections import defaultdict
from pathlib import Path

from triosim.trace.model import Trace

TABLE_FILE = Path(__file__).resolve().parent / "calibration" / "h100-kernels.json"
TRACES = Path(__file__).resolve().parents[1] / "traces" / "h100"


def build(traces) -> dict[tuple[str, str], int]:
    """(phase, operator name) -> the lower median of its operators' kernel counts."""
    seen = defaultdict(list)
    for t in traces:
        for op in t.operators:
            seen[(op.phase, op.name)].append(op.kernels)
    return {k: statistics.median_low(v) for k, v in sorted(seen.items())}


@functools.lru_cache(maxsize=1)
def table() -> dict[tuple[str, str], int]:
    doc = json.loads(TABLE_FILE.read_text())
    return {(r["phase"], r["name"]): r["kernels"] for r in doc["kernels"]}


def count_kernels(trace: Trace, counts: dict | None = None) -> int:
    """Give each operator of a name in `counts` (default: the shipped table) its count, in
    place; returns how many operators took one."""
    counts = table() if counts is None else counts
    known = 0
    for op in trace.operators:
        k = counts.get((op.phase, op.name))
        if k is not None:
            op.kernels = k
            known += 1
    return known


def source_note(known: int, total: int) -> str:
    """What a modelled trace's metadata `kernels_source` says."""
    return (
        f"{known} of {total} operators: the real H100 traces' count per operator name "
        f"({TABLE_FILE.name}), the same on any GPU; the others the meta run's leaf operators"
    )


def recount(paths) -> None:
    """Give shipped shape-only traces the table's counts in place (what tracing them again
    with `triosim trace --shapes-only` writes, without the tracing)."""
    from triosim.trace.model import load, save

    for path in paths:
        t = load(path)
        if not t.metadata.get("shapes_only"):
            raise SystemExit(f"{path}: not a shape-only trace (its counts are its GPU's)")
        t.metadata["kernels_source"] = source_note(count_kernels(t), len(t.operators))
        save(t, path)
        print(f"{path}: {t.metadata['kernels_source'].split(':')[0]}")


def main(argv=None) -> int:
    import sys

    from triosim.trace.model import load

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--recount"]:  # python -m perfmodel.kernel_counts --recount FILE...
        recount(argv[1:])
        return 0

    files = sorted(TRACES.glob("*.trace.json.gz")) + sorted(
        (TRACES / "imported").glob("*.trace.json.gz")
    )
    counts = build(load(f) for f in files)
    doc = {
        "about": "GPU kernels per operator: the lower median over the real H100 traces named "
        "(perfmodel/kernel_counts.py)",
        "traces": [str(f.relative_to(TRACES.parents[1])) for f in files],
        "kernels": [{"phase": p, "name": n, "kernels": k} for (p, n), k in counts.items()],
    }
    TABLE_FILE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(counts)} operator names from {len(files)} traces -> {TABLE_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
