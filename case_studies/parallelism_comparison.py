"""Case study (paper Figure 12): data, tensor and pipeline (GPipe) parallelism on 4
A100-class GPUs connected by NVLink, at a fixed total batch of 128 (pipeline micro-batch 64),
per model. Topology: fully connected, 100 GB/s per pair and direction (4 NVLink-3 links, as
in a 4-GPU HGX A100 board). Writes parallelism.csv and parallelism.png.
Run: python -m case_studies.parallelism_comparison --out out/parallelism
"""

from __future__ import annotations

import argparse

from case_studies.common import find_trace, grouped_bars, out_dir, write_csv
from triosim.simulation.wiring import Simulation

MODELS = [
    ("VGG-11", "vgg11", "cnn"),
    ("ResNet-50", "resnet50", "cnn"),
    ("DenseNet-121", "densenet121", "cnn"),
]
MODES = {"DP": {"mode": "dp"}, "TP": {"mode": "tp"}, "GPipe": {"mode": "gpipe", "microbatches": 2}}


def study(models=MODELS, gpu="A100", batch=128) -> list[dict]:
    rows = []
    for name, trace_name, kind in models:
        trace, source = find_trace(trace_name, gpu, kind)
        for mode, par in MODES.items():
            cfg = {
                "trace": trace,
                "num_gpus": 4,
                "batch_size": batch,
                "parallelism": par,
                "topology": {"kind": "fully_connected", "bandwidth": "100 GB/s", "latency": "1 us"},
            }
            r = Simulation(cfg).run()
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "iteration_ms": r.iteration_time * 1e3,
                    "times_from": source,
                }
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/parallelism")
    args = ap.parse_args(argv)
    folder = out_dir(args.out)
    rows = study()
    write_csv(folder / "parallelism.csv", rows)
    for r in rows:
        print(f"{r['model']:<13} {r['mode']:<6} {r['iteration_ms']:>10.2f} ms")
    models = list(dict.fromkeys(r["model"] for r in rows))
    series = {
        m: [
            next(r["iteration_ms"] for r in rows if r["model"] == mo and r["mode"] == m)
            for mo in models
        ]
        for m in MODES
    }
    grouped_bars(
        folder / "parallelism.png",
        models,
        series,
        "ms per iteration",
        "4 GPUs, NVLink 100 GB/s per pair, total batch 128 (GPipe: 2 x 64)",
        note=rows[0]["times_from"].split(" (")[0],
    )
    print(f"wrote parallelism.csv and parallelism.png into {folder}")
    return rows


if __name__ == "__main__":
    main()
