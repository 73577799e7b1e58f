"""Case study (paper section 7.1, Figure 15): an 84-GPU wafer (12 x 7 A100-class GPUs)
training with data parallelism: an electrical 2D mesh with the ring laid over it, against a
photonic circuit switch (484 GB/s over 8 links per GPU, 20 ms circuit set-up).

Steady state: two iterations are simulated and the second is reported, so the photonic
circuits are already set up (as in training, where they persist). The paper does not give
the electrical link bandwidth; it reports 92% communication for VGG-19 on the electrical
mesh, which on these A100 times (VGG-19, batch 64 per GPU: 210 ms of compute, 548 MB of
gradients, a ring all-reduce over 84 GPUs) takes about 0.5 GB/s per mesh link, so that is the
default (`--bandwidth`); `--sweep` shows how the answer moves with it (the photonic network
wins below a few tens of GB/s per link and loses above). Each GPU keeps a per-GPU batch
(weak scaling). Writes wafer.csv, wafer.png and wafer_sensitivity.png.
Run: python -m case_studies.wafer_scale_photonic --out out/wafer
"""

from __future__ import annotations

import argparse

from case_studies.common import find_trace, out_dir, share_bars, write_csv
from triosim.simulation.wiring import Simulation

# (name, trace name, kind, per-GPU batch)
MODELS = [
    ("VGG-19", "vgg19", "cnn", 64),
    ("ResNet-50", "resnet50", "cnn", 128),
    ("DenseNet-121", "densenet121", "cnn", 64),
    ("GPT-2", "gpt2", "transformer", 8),
    ("Llama-3.2-1B", "llama", "transformer", 1),
]
NETWORKS = {
    "electrical": {"kind": "packet"},
    "photonic": {
        "kind": "photonic",
        "total_bandwidth": "484 GB/s",
        "links": 8,
        "setup_time": "20 ms",
    },
}


def run(trace: str, batch: int, network: dict, bandwidth: str, mode: str = "dp") -> dict:
    cfg = {
        "trace": trace,
        "num_gpus": 84,
        "batch_size": 84 * batch,
        "iterations": 2,
        "parallelism": {"mode": mode},
        "topology": {
            "kind": "mesh2d",
            "rows": 12,
            "cols": 7,
            "bandwidth": bandwidth,
            "latency": "20 ns",
        },
        "network": network,
    }
    r = Simulation(cfg).run()
    g = r.per_gpu()
    return {
        "iteration_ms": r.iteration_time * 1e3,
        "first_iteration_ms": r.first_iteration_time * 1e3,
        "compute_ms": float(g["compute"].mean()) * 1e3,
        "exposed_comm_ms": float(g["exposed_comm"].mean()) * 1e3,
    }


def study(models=MODELS, bandwidths=("0.5 GB/s",)) -> list[dict]:
    rows = []
    for name, trace_name, kind, batch in models:
        trace, source = find_trace(trace_name, "A100", kind)
        for bw in bandwidths:
            for net_name, net in NETWORKS.items():
                if net_name == "photonic" and bw != bandwidths[0]:
                    continue  # the photonic network does not use the mesh's links
                res = run(trace, batch, net, bw)
                rows.append(
                    {
                        "model": name,
                        "network": net_name,
                        "electrical_bandwidth": bw if net_name == "electrical" else "",
                        **res,
                        "comm_share": res["exposed_comm_ms"] / res["iteration_ms"],
                        "times_from": source,
                    }
                )
    return rows


def plot(rows, path, bandwidth):
    main = [r for r in rows if r["network"] == "photonic" or r["electrical_bandwidth"] == bandwidth]
    share_bars(
        path,
        [f"{r['model']}\n{r['network']}" for r in main],
        [r["compute_ms"] / r["iteration_ms"] for r in main],
        [r["exposed_comm_ms"] / r["iteration_ms"] for r in main],
        f"84-GPU wafer, data parallel: electrical mesh ({bandwidth}/link) vs photonic\n"
        f"{main[0]['times_from'].split(' (')[0]}",
        ylabel="share of the iteration (steady state)",
        above=[f"{r['iteration_ms']:.0f} ms" for r in main],
    )


def plot_sensitivity(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        el = [r for r in rows if r["model"] == model and r["network"] == "electrical"]
        ph = next(r for r in rows if r["model"] == model and r["network"] == "photonic")
        xs = [float(r["electrical_bandwidth"].split()[0]) for r in el]
        (line,) = ax.plot(xs, [r["comm_share"] for r in el], marker="o", label=model)
        ax.axhline(ph["comm_share"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("electrical mesh link bandwidth (GB/s per direction)")
    ax.set_ylabel("exposed communication share")
    ax.set_title("Sensitivity to the electrical bandwidth (dotted: photonic)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/wafer")
    ap.add_argument("--bandwidth", default="0.5 GB/s", help="electrical mesh link bandwidth")
    ap.add_argument(
        "--sweep",
        nargs="*",
        default=["2 GB/s", "10 GB/s", "50 GB/s", "200 GB/s"],
        help="more electrical bandwidths for the sensitivity plot",
    )
    args = ap.parse_args(argv)
    folder = out_dir(args.out)
    rows = study(bandwidths=(args.bandwidth, *args.sweep))
    write_csv(folder / "wafer.csv", rows)
    print(
        f"{'model':<13} {'network':<10} {'bw':>9} {'iter ms':>9} {'compute':>9} {'exp.comm':>9} {'share':>6}"
    )
    for r in rows:
        print(
            f"{r['model']:<13} {r['network']:<10} {r['electrical_bandwidth']:>9} "
            f"{r['iteration_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['exposed_comm_ms']:>9.2f} "
            f"{r['comm_share']:>6.0%}"
        )
    plot(rows, folder / "wafer.png", args.bandwidth)
    plot_sensitivity(rows, folder / "wafer_sensitivity.png")
    print(f"wrote wafer.csv, wafer.png, wafer_sensitivity.png into {folder}")
    return rows


if __name__ == "__main__":
    main()
