"""The NCCL model against published nccl-tests all_reduce_perf tables.

For every table in benchmarks/data/nccl_tests/ (see its README for sources), the config of
the measured system is built from the catalogue (triosim/hardware/catalogue.py: NVLink 3/4, IB
HDR/NDR bandwidth and latency; GPU; NIC count) and the NCCL settings the run states
(NCCL_ALGO, NCCL_MIN_CTAS). Each size is simulated with `triosim collectives` machinery:
(a) with the catalogue figures only, (b) with `triosim calibrate` fitted on every other
row (0, 2, 4, ...) predicting the other rows. Printed: predicted vs measured time per size
(--detail) and the median absolute error of the time per size range.

Run: python benchmarks/nccl_tests_comparison.py [--detail] [--only NAME ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from triosim.config.loading import from_dict
from triosim.hardware import catalogue as hardware
from triosim.hardware import nccl_tests
from triosim.studies.calibration import calibrate, collective_times, errors_by_range

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"
NVL4, NVL3 = hardware.link("nvlink4"), hardware.link("nvlink3")
NDR, HDR = hardware.link("ib-ndr"), hardware.link("ib-hdr")


def node(gpu, link, nvls):
    return {
        "gpu": gpu,
        "topology": {
            "kind": "switch",
            "bandwidth": link.bandwidth,
            "latency": link.latency,
            "nvls": nvls,
        },
    }


def nodes(n, gpu, link, nic_bw, nic_lat, nvls, sharp=False):
    """n nodes of 8 GPUs, one NIC (nic_bw: the node's NIC bandwidth / 8) per GPU, rails."""
    return {
        "gpu": gpu,
        "num_gpus": 8 * n,
        "topology": {
            "kind": "multi_node",
            "gpus_per_node": 8,
            "bandwidth": link.bandwidth,
            "latency": link.latency,
            "inter_bandwidth": nic_bw,
            "inter_latency": nic_lat,
            "nvls": nvls,
            "sharp": sharp,
        },
    }


H100, A100_80, A100_40 = "H100-SXM", "A100-80GB", "A100-40GB"
# file stem -> (label, fabric class, config fields, NCCL options the run set)
SYSTEMS = {
    "h100_8gpu_allreduce_dgxc-benchmarking": (
        "8xH100 NVSwitch (DGX Cloud)",
        "node",
        node(H100, NVL4, True),
        {},
    ),
    "h100_8gpu_allreduce_aws-p5-batch": (
        "8xH100 NVSwitch (AWS p5)",
        "node",
        node(H100, NVL4, True),
        {},
    ),
    "a100_8gpu_allreduce_azure-ndmv4-aml": (
        "8xA100-80GB NVSwitch (Azure)",
        "node",
        node(A100_80, NVL3, False),
        {},
    ),
    "a100_8gpu_allreduce_oci-bm-gpu4": (
        "8xA100-40GB NVSwitch (OCI, old NCCL)",
        "node",
        node(A100_40, NVL3, False),
        {},
    ),
    "a100_8gpu_allreduce_stas00-ml-engineering": (
        "8xA100 NVSwitch (stas00)",
        "node",
        node(A100_80, NVL3, False),
        {},
    ),
    "h100_2node_16gpu_allreduce_nccl-tests-issue309": (
        "2x8 H100, IB NDR 8x400G",
        "IB",
        nodes(2, H100, NVL4, NDR.bandwidth, NDR.latency, True),
        {},
    ),
    "h100_2node_16gpu_allreduce_ring_nccl-tests-issue309": (
        "2x8 H100, IB 8x400G, NCCL_ALGO=Ring",
        "IB",
        nodes(2, H100, NVL4, NDR.bandwidth, NDR.latency, True),
        {"algorithm": "ring", "channels": 24},
    ),
    "h100_4node_32gpu_allreduce_nccl-tests-issue309": (
        "4x8 H100, IB NDR 8x400G",
        "IB",
        nodes(4, H100, NVL4, NDR.bandwidth, NDR.latency, True),
        {},
    ),
    "h100_8node_64gpu_allreduce_nccl-tests-issue309_default": (
        "8x8 H100, IB 400G (default)",
        "IB",
        nodes(8, H100, NVL4, NDR.bandwidth, NDR.latency, True),
        {},
    ),
    "h100_8node_64gpu_allreduce_nccl-tests-issue309_tuned": (
        "8x8 H100, IB 400G, MIN_CTAS=24",
        "IB",
        nodes(8, H100, NVL4, NDR.bandwidth, NDR.latency, True),
        {"channels": 24},
    ),
    "h100_12node_96gpu_allreduce_coreweave-sharp_large": (
        "12x8 H100, IB NDR + SHARP",
        "IB",
        nodes(12, H100, NVL4, NDR.bandwidth, NDR.latency, True, sharp=True),
        {},
    ),
    # 16 x 200 Gb/s RoCE ports a node: 400 Gb/s (50 GB/s) a GPU, as NDR
    "h100_2node_16gpu_allreduce_oci-roce_large": (
        "2x8 H100, RoCE 16x200G",
        "IB",
        nodes(2, H100, NVL4, 50e9, NDR.latency, True),
        {},
    ),
    "a100_2node_16gpu_allreduce_azure-ndmv4-aks": (
        "2x8 A100, IB HDR 8x200G",
        "IB",
        nodes(2, A100_80, NVL3, HDR.bandwidth, HDR.latency, False),
        {},
    ),
    # 16 x 100 Gb/s RoCE a node: 200 Gb/s (25 GB/s) a GPU; the run is untuned (72 GB/s)
    "a100_2node_16gpu_allreduce_oci-roce": (
        "2x8 A100, RoCE 16x100G (untuned run)",
        "other",
        nodes(2, A100_40, NVL3, 25e9, HDR.latency, False),
        {},
    ),
    # not InfiniBand/RoCE: NCCL's NET latencies are IB's; reported, not targeted
    "h100_2node_16gpu_allreduce_aws-p5-efa": (
        "2x8 H100, AWS EFA 32x100G",
        "other",
        nodes(2, H100, NVL4, 50e9, NDR.latency, True),
        {},
    ),
    "a100_2node_16gpu_allreduce_aws-p4de-efa": (
        "2x8 A100, AWS EFA 4x100G",
        "other",
        nodes(2, A100_80, NVL3, 6.25e9, NDR.latency, False),
        {},
    ),
    "h100_2node_16gpu_allreduce_gcp-a3mega-tcpxo": (
        "2x8 H100, GCP TCPXO 8x200G",
        "other",
        nodes(2, H100, NVL4, 25e9, NDR.latency, True),
        {},
    ),
}


def config(stem: str, calibration=None):
    _, _, fields, comm = SYSTEMS[stem]
    data = {"trace": "<none>", "num_gpus": 8, **fields, "communication": {"kind": "nccl", **comm}}
    if calibration is not None:
        data["communication"] = {**data["communication"], "calibration": str(calibration)}
    return from_dict(data)


def table(stem: str):
    return nccl_tests.parse((DATA / f"{stem}.txt").read_text(), op="all_reduce")[0]


def compare(stem: str, tmp: Path, rows=None):
    """Per size: (size, measured s, catalogue s, calibrated s or None, held out?)."""
    t = table(stem)
    rows = t.rows if rows is None else rows
    cfg = config(stem)
    sizes = [r.size for r in rows]
    cat = [s for _, _, s, _, _ in collective_times(cfg, "all_reduce", sizes)]
    fit_rows = t.rows[0::2]
    tuning, report = calibrate(cfg, t, fit_rows)
    from triosim.studies.calibration import write_calibration

    path = write_calibration(tmp / f"{stem}.yaml", tuning, report, source=stem)
    cal = [s for _, _, s, _, _ in collective_times(config(stem, path), "all_reduce", sizes)]
    fitted = {id(r) for r in fit_rows}
    return [
        (r.size, r.time, c, k, id(r) not in fitted) for r, c, k in zip(rows, cat, cal, strict=True)
    ]


def summarise(result):
    sizes = [s for s, *_ in result]
    meas = [m for _, m, *_ in result]
    a = errors_by_range(sizes, [c for _, _, c, _, _ in result], meas)
    held = [x for x in result if x[4]]
    b = errors_by_range([x[0] for x in held], [x[3] for x in held], [x[1] for x in held])
    return a, b


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def main(argv=None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--detail", action="store_true", help="predicted vs measured per size")
    ap.add_argument("--only", nargs="*", help="file stems to run (default: all)")
    args = ap.parse_args(argv)
    stems = args.only or list(SYSTEMS)
    lines = []
    with tempfile.TemporaryDirectory() as d:
        for stem in stems:
            label, klass, _, _ = SYSTEMS[stem]
            result = compare(stem, Path(d))
            a, b = summarise(result)
            if args.detail:
                print(f"\n{label} ({stem})")
                print(
                    f"{'size B':>12} {'measured us':>12} {'catalogue us':>13} {'err':>6} "
                    f"{'calibrated us':>14} {'err':>6}"
                )
                for size, m, c, k, held in result:
                    mark = "" if held else "  (fitted)"
                    print(
                        f"{size:>12} {m * 1e6:>12.1f} {c * 1e6:>13.1f} {c / m - 1:>+6.0%} "
                        f"{k * 1e6:>14.1f} {k / m - 1:>+6.0%}{mark}"
                    )
            lines.append((klass, label, len(result), a, b))
    print(
        "\nMedian |predicted / measured - 1| of all_reduce time, by size range "
        "(a: catalogue figures; b: calibrated on every other row, held-out rows)"
    )
    print(
        "| system | class | rows | a <1MiB | a 1-64MiB | a >=64MiB | b <1MiB | b 1-64MiB | "
        "b >=64MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for klass, label, n, a, b in lines:
        cells = [_pct(a[k]) for k in a] + [_pct(b[k]) for k in b]
        print(f"| {label} | {klass} | {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
