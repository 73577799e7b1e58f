"""Single-GPU batch scaling on real GPU traces (the paper's Figure 6 experiment).

For each model under traces/<gpu-name>/ (every folder but cpu/ and modelled/, whose times
are not measured on a GPU), predict the batch-256
iteration time from the batch-128 trace (transformers: 32 from 16) with the regression
model and compare with the measured time; prints a table and the mean absolute
percentage error. The paper reports 1.10% (A40) and 3.25% (A100).
Run: python benchmarks/single_gpu_batch_scaling.py
"""

from __future__ import annotations

from pathlib import Path

from batch_scaling import rows, table

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    gpu_dirs = [
        d
        for d in sorted((ROOT / "traces").iterdir())
        if d.is_dir() and d.name not in ("cpu", "modelled")
    ]
    if not gpu_dirs:
        print("no GPU traces under traces/ (they come from the GPU machine; see traces/README.md)")
    for d in gpu_dirs:
        print(f"== {d.name}")
        table(rows(d, pairs={(128, 256), (16, 32)}))
