"""Case study (paper Figure 13): communication against computation for tensor parallelism
and DDP, per model, on 2 A40-class GPUs connected by PCIe 4.0 (32 GB/s per direction, both
under one PCIe switch). Writes comm_breakdown.csv and comm_breakdown.png.
Run: python -m case_studies.comm_breakdown --out out/comm
"""

from __future__ import annotations

import argparse

from case_studies.common import find_trace, out_dir, share_bars, write_csv
from triosim.simulation.wiring import Simulation

MODELS = [
    ("VGG-11", "vgg11", "cnn", 64),
    ("ResNet-50", "resnet50", "cnn", 64),
    ("DenseNet-121", "densenet121", "cnn", 64),
    ("GPT-2", "gpt2", "transformer", 8),
]


def study(models=MODELS, gpu="A40") -> list[dict]:
    rows = []
    for name, trace_name, kind, batch in models:
        trace, source = find_trace(trace_name, gpu, kind)
        for mode in ("tp", "ddp"):
            cfg = {
                "trace": trace,
                "num_gpus": 2,
                "batch_size": batch,
                "parallelism": {"mode": mode},
                "topology": {
                    "kind": "pcie_tree",
                    "bandwidth": "32 GB/s",
                    "latency": "1 us",
                    "per_switch": 2,
                },
            }
            r = Simulation(cfg).run()
            g = r.per_gpu()
            comp, comm = float(g["compute"].mean()), float(g["exposed_comm"].mean())
            rows.append(
                {
                    "model": name,
                    "mode": mode.upper(),
                    "iteration_ms": r.iteration_time * 1e3,
                    "compute_ms": comp * 1e3,
                    "exposed_comm_ms": comm * 1e3,
                    "comm_share": comm / r.iteration_time,
                    "times_from": source,
                }
            )
    return rows


def plot(rows, path):
    share = [r["comm_share"] for r in rows]
    share_bars(
        path,
        [f"{r['model']}\n{r['mode']}" for r in rows],
        [1 - x for x in share],
        share,
        "2 GPUs over PCIe 4.0: TP vs DDP\n" + rows[0]["times_from"].split(" (")[0],
        compute_label="computation",
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/comm")
    args = ap.parse_args(argv)
    folder = out_dir(args.out)
    rows = study()
    write_csv(folder / "comm_breakdown.csv", rows)
    for r in rows:
        print(
            f"{r['model']:<13} {r['mode']:<4} {r['iteration_ms']:>10.2f} ms  "
            f"comm {r['comm_share']:.0%}"
        )
    plot(rows, folder / "comm_breakdown.png")
    print(f"wrote comm_breakdown.csv and comm_breakdown.png into {folder}")
    return rows


if __name__ == "__main__":
    main()
