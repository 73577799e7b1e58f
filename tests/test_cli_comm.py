"""`triosim collectives` and `triosim calibrate`, end to end."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from triosim.cli.main import main
from triosim.config.loading import from_dict
from triosim.hardware import nccl_tests
from triosim.studies.calibration import calibrate

ROOT = Path(__file__).resolve().parents[1]
A100_NODE = {
    "trace": "none.json",
    "num_gpus": 8,
    "gpu": "A100-80GB",
    "topology": {"kind": "switch", "bandwidth": "300 GB/s", "latency": "0.7 us"},
}


def write(tmp_path, data, name="sys.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def run_collectives(capsys, *args):
    assert main(["collectives", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_collectives_prints_nccl_tests_lines(tmp_path, capsys):
    cfg = write(tmp_path, A100_NODE)
    out = run_collectives(capsys, cfg, "--op", "all_reduce", "-b", "8", "-e", "1G", "-f", "2")
    [t] = nccl_tests.parse(out, op="all_reduce")
    assert [r.size for r in t.rows] == [2**k for k in range(3, 31)]
    assert t.ranks == 8  # busbw = algbw x 2(n-1)/n, as nccl-tests prints it
    big = t.rows[-1]
    # 1 GiB on NCCL's Ring/Simple: 8.4 + 14 x 3.4 us + S / (240 GB/s x 8/14)
    assert big.time == pytest.approx((8.4 + 14 * 3.4) * 1e-6 + 2**30 / (240e9 * 8 / 14), rel=1e-3)
    assert big.algbw == pytest.approx(2**30 / big.time / 1e9, rel=1e-3)


@pytest.mark.parametrize(
    "op", ["all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv"]
)
def test_collectives_every_op(tmp_path, capsys, op):
    cfg = write(tmp_path, A100_NODE)
    out = run_collectives(capsys, cfg, "--op", op, "-b", "1K", "-e", "1M", "-f", "4")
    [t] = nccl_tests.parse(out, op=op)
    assert len(t.rows) == 6 and all(r.time > 0 for r in t.rows)
    assert t.rows[0].root == (0 if op in ("broadcast", "reduce") else -1)
    factor = nccl_tests.busbw_factor(op, 8)
    assert all(r.busbw == pytest.approx(r.algbw * factor, abs=0.02) for r in t.rows)


def test_calibrate_recovers_the_tuning_a_log_was_made_with(tmp_path, capsys):
    # a "measurement" made by the model with a known tuning: launch 7 us, Simple at 80 %
    cfg = write(tmp_path, A100_NODE)
    made = dict(
        A100_NODE, communication={"kind": "nccl", "launch_overhead": "7 us", "bandwidth_scale": 0.8}
    )
    log = tmp_path / "measured.log"
    log.write_text(
        run_collectives(
            capsys, write(tmp_path, made, "made.yaml"), "-b", "8", "-e", "4G", "-f", "2"
        )
    )
    out = tmp_path / "calib.yaml"
    assert main(["calibrate", str(log), "--config", str(cfg), "--out", str(out)]) == 0
    fitted = yaml.safe_load(out.read_text())["tuning"]
    assert fitted["launch_overhead"] == pytest.approx(7e-6, rel=0.05)
    assert fitted["bandwidth_scale_Simple"] == pytest.approx(0.8, rel=0.02)
    assert fitted["latency_scale"] == pytest.approx(1.0, rel=0.05)
    # and the config that names the file reproduces the log
    again = dict(A100_NODE, communication={"kind": "nccl", "calibration": str(out)})
    [t] = nccl_tests.parse(
        run_collectives(
            capsys, write(tmp_path, again, "again.yaml"), "-b", "8", "-e", "4G", "-f", "2"
        ),
        op="all_reduce",
    )
    [m] = nccl_tests.parse(log.read_text(), op="all_reduce")
    assert all(
        a.time == pytest.approx(b.time, rel=0.03) for a, b in zip(t.rows, m.rows, strict=True)
    )


def test_calibrate_refuses_a_log_of_another_rank_count(tmp_path):
    [t] = nccl_tests.parse(
        (
            ROOT / "benchmarks/data/nccl_tests/h100_2node_16gpu_allreduce_nccl-tests-issue309.txt"
        ).read_text()
    )
    with pytest.raises(Exception, match="num_gpus"):
        calibrate(from_dict(A100_NODE), t)


def _comparison():
    spec = importlib.util.spec_from_file_location(
        "nccl_tests_comparison", ROOT / "benchmarks" / "nccl_tests_comparison.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "stem,sizes,catalogue,calibrated",
    [
        # (published table, sizes checked, bound with catalogue figures, bound calibrated)
        ("h100_8gpu_allreduce_dgxc-benchmarking", [2**21, 2**23, 2**25, 2**28, 2**30], 0.12, 0.06),
        ("a100_2node_16gpu_allreduce_azure-ndmv4-aks", [2**22, 2**25, 2**26, 2**29], 0.25, 0.08),
    ],
)
def test_reduced_comparison_with_published_measurements(
    tmp_path, stem, sizes, catalogue, calibrated
):
    mod = _comparison()
    rows = [r for r in mod.table(stem).rows if r.size in sizes]
    assert len(rows) == len(sizes)
    for size, measured, cat, cal, _ in mod.compare(stem, tmp_path, rows):
        assert cat == pytest.approx(measured, rel=catalogue), size
        assert cal == pytest.approx(measured, rel=calibrated), size
