"""The B200 in the catalogue (issue 45: GPUs users have), from NVIDIA's sheets, by hand: the
Blackwell technical brief's HGX B200 figures "with sparsity" halved for the dense peaks, the
DGX B200 datasheet's 8-GPU totals divided by 8, NVLink 5 twice NVLink 4."""

from __future__ import annotations

import pytest

from perfmodel import Roofline, Target
from triosim.hardware import catalogue as hardware
from triosim.hardware.nccl_constants import arch_of
from triosim.trace.model import Operator, Tensor, Trace

T, GB = 1e12, 1e9


def test_the_b200s_figures_are_its_sheets():
    g = hardware.gpu("NVIDIA B200")
    sparse = {"tf32": 2.2e15, "float16": 4.5e15, "bfloat16": 4.5e15, "float8": 9e15}
    for mode, s in sparse.items():
        assert g.flops_for(mode) == pytest.approx(s / 2)
    assert g.flops_for("float32") == 80 * T and g.flops_for("float64") == 40 * T
    assert g.memory_capacity == pytest.approx(1440 * GB / 8)  # DGX B200: 1,440 GB in all
    assert g.memory_bandwidth == pytest.approx(64e12 / 8)  # DGX B200: 64 TB/s in all
    assert hardware.link("nvlink5").bandwidth == 2 * hardware.link("nvlink4").bandwidth
    assert g.compute_capability == (10, 0) and arch_of("B200") == 100


def test_a_compute_bound_product_runs_at_the_peak_ratio_and_a_copy_at_the_bandwidth_ratio():
    # the roofline keeps each kind's efficiency from the H100 trace: a bfloat16 product of
    # 1 TFLOP on few bytes is compute-bound on both, so B200 / H100 = 989.4 / 2250; a copy
    # of 8 GB (no FLOPs) moves at the memory bandwidths: 3.35 / 8 TB/s
    tensors = {
        0: Tensor(0, (1,), "bfloat16", 1e6, "activation"),
        1: Tensor(1, (1,), "bfloat16", 1e6, "activation"),
        2: Tensor(2, (1,), "bfloat16", 4e9, "activation"),
        3: Tensor(3, (1,), "bfloat16", 4e9, "activation"),
    }
    ops = [
        Operator(0, "aten::mm", "l", "forward", 2e-3, (0,), (1,), 1e12, math="bfloat16"),
        Operator(1, "aten::copy_", "l", "forward", 3e-3, (2,), (3,), None),
    ]
    t = Trace(ops, tensors, {"batch_size": 1, "gpu": "H100-SXM", "dtype": "bfloat16"})
    m = Roofline(t.validate())
    mm, copy = (m.time(op, Target(gpu="B200")) for op in ops)
    assert mm == pytest.approx(2e-3 * 989.4 / 2250, rel=1e-9)
    assert copy == pytest.approx(3e-3 * 3350 / 8000, rel=1e-9)
