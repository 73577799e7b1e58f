"""Determinism across processes and large inputs."""

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace, load, save

ROOT = Path(__file__).resolve().parents[1]


def fingerprint() -> str:
    """One line per example: a hash of its timeline and transfers, and its iteration time."""
    lines = []
    for name in ("ddp", "gpipe", "tp"):
        r = Simulation(ROOT / "examples" / f"{name}.yaml").run()
        data = r.timeline.to_csv(index=False) + r.transfers().to_csv(index=False)
        lines.append(f"{name} {hashlib.sha256(data.encode()).hexdigest()} {r.iteration_time!r}")
    return "\n".join(lines)


@pytest.mark.no_cover
def test_same_config_same_numbers_across_processes():
    # set and dict order of strings follows PYTHONHASHSEED: two processes with different
    # seeds (run side by side) and this one must agree to the last bit
    script = "from tests.test_reliability import fingerprint; print(fingerprint())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]
    here = fingerprint()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert outs == [here, here]


def big_trace(n_ops=200_000):
    tensors = {i: Tensor(i, (8, 64), "float32", 2048.0, "activation") for i in range(1000)}
    ops = [
        Operator(
            i, "aten::add", f"l{i % 50}", "forward", 1e-6, (i % 1000,), ((i + 1) % 1000,), 512.0
        )
        for i in range(n_ops)
    ]
    return Trace(ops, tensors, {"batch_size": 8})


@pytest.mark.no_cover
def test_200k_operator_trace_loads_and_simulates(tmp_path):
    # 200 000 operators of 1 us each, replayed on one GPU: 0.2 s
    t = load(save(big_trace(), tmp_path / "big.trace.json"), progress=True)
    r = Simulation({"num_gpus": 1}, trace=t).run()
    assert len(t.operators) == 200_000 and len(r.timeline) == 200_000
    assert r.iteration_time == pytest.approx(0.2, rel=1e-9)
    assert json.loads(json.dumps(r.summary_dict()))["iteration_time_ms"] == pytest.approx(200)


@pytest.mark.no_cover
def test_run_memory_is_linear_in_timeline_rows():
    # a run keeps one timeline row per task (about 0.5 kB each with the DataFrame built
    # from them): its peak allocation per row stays under 2 kB and 4x the rows costs about
    # 4x the memory. A copy of the trace per row, or anything quadratic, breaks both.
    def peak(n):
        sim = Simulation({"num_gpus": 1}, trace=big_trace(n))
        tracemalloc.start()
        try:
            rows = len(sim.run().timeline)
            return tracemalloc.get_traced_memory()[1], rows
        finally:
            tracemalloc.stop()

    (small, n1), (large, n2) = peak(4000), peak(16000)
    assert (n1, n2) == (4000, 16000)
    assert small / n1 < 2000 and large / n2 < 2000
    assert large < 4 * 1.25 * small
