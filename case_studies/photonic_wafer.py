"""Case study (paper section 7.1, Figure 15 in shape): a 12 x 7 wafer of 84 GPUs training
with data parallelism, electrical mesh vs photonic circuit switch.

Electrical: a 2D mesh of links (default 100 GB/s each way, 20 ns per hop), the ring laid
snake-wise over neighbouring GPUs. Photonic: 484 GB/s over 8 links per GPU, 20 ms circuit
set-up, 8 ports, any-to-any. Each GPU keeps the traced per-GPU batch (weak scaling).
Models: the original TrioSim's H100 traces of VGG-13 and ResNet-50 (batch 128) retargeted
to A100s with the roofline model, when shared/reference is beside the repository;
otherwise the shipped CPU traces as they are.
Run: python case_studies/photonic_wafer.py [--mode dp|ddp] [--bandwidth "100 GB/s"] [--out wafer.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from triosim.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]
GO = ROOT.parent / "shared" / "reference" / "triosim-go-traces"
CPU = ["traces/cpu/resnet18-b8.trace.json.gz", "traces/cpu/gpt2-small-b8.trace.json.gz"]


def models():
    """(name, trace path, per-GPU batch, extra config) for each model of the study."""
    if GO.exists():
        a100 = {"gpu": "A100-80GB", "perfmodel": {"kind": "roofline", "source_gpu": "H100-SXM"}}
        return [(m, str(GO / m), 128, a100) for m in ("vgg13", "resnet50")]
    return [(Path(p).name.split("-b")[0], str(ROOT / p), 8, {}) for p in CPU]


def run(trace: str, batch: int, extra: dict, network: dict, mode: str, bandwidth: str):
    cfg = {"trace": trace, "num_gpus": 84, "batch_size": 84 * batch,
           "parallelism": {"mode": mode},
           "topology": {"kind": "mesh2d", "rows": 12, "cols": 7, "bandwidth": bandwidth,
                        "latency": "20 ns"},
           "network": network, **extra}  # fmt: skip
    r = Simulation(cfg).run()
    g = r.per_gpu()
    return r.iteration_time, float(g["compute"].mean()), float(g["exposed_comm"].mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="dp", choices=["dp", "ddp"])
    ap.add_argument("--bandwidth", default="100 GB/s", help="electrical mesh link bandwidth")
    ap.add_argument("--out", default="photonic_wafer.png")
    args = ap.parse_args()
    nets = {"electrical": {"kind": "packet"},
            "photonic": {"kind": "photonic", "total_bandwidth": "484 GB/s", "links": 8,
                         "setup_time": "20 ms"}}  # fmt: skip
    rows = []
    print(
        f"{'model':<12} {'network':<11} {'iteration ms':>13} {'compute ms':>11} {'exposed comm ms':>16} {'comm share':>10}"
    )
    for name, trace, batch, extra in models():
        for net_name, net in nets.items():
            it, comp, comm = run(trace, batch, extra, net, args.mode, args.bandwidth)
            rows.append((name, net_name, it, comp, comm))
            print(f"{name:<12} {net_name:<11} {it * 1e3:>13.3f} {comp * 1e3:>11.3f} "
                  f"{comm * 1e3:>16.3f} {comm / it:>10.1%}")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{m}\n{n}" for m, n, *_ in rows]
    ax.bar(labels, [r[3] * 1e3 for r in rows], label="compute")
    ax.bar(labels, [r[4] * 1e3 for r in rows], bottom=[r[3] * 1e3 for r in rows],
           label="exposed communication")  # fmt: skip
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"84-GPU wafer, {args.mode}: electrical mesh vs photonic")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
