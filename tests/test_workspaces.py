"""PyTorch's cuBLAS workspaces in the memory model (triosim.results.workspaces): their sizes
by hand from PyTorch's defaults, and a simulated peak that holds them for the whole run."""

import pytest

from triosim.results.workspaces import cublas_workspace, library_bytes
from triosim.simulation.wiring import Simulation
from triosim.trace.model import Operator, Tensor, Trace

MIB = 2**20


def test_workspace_sizes_by_hand():
    # CublasHandlePool.cpp: 4096 KiB x 8 on compute capability 9.0, else ":4096:2:16:8"
    assert cublas_workspace((9, 0)) == 4096 * 1024 * 8 == 32 * MIB
    assert cublas_workspace((8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert cublas_workspace((8, 6)) == cublas_workspace(None) == 8_519_680
    # two handles (the loop's thread and autograd's): 64 MiB on an H100 or H200
    assert library_bytes("H100-SXM") == library_bytes("H200") == 64 * MIB
    assert library_bytes("A100-80GB") == 2 * 8_519_680
    # no GPU named (a CPU trace), or one the catalogue does not know: nothing
    assert library_bytes(None) == library_bytes("not-a-gpu") == 0.0


def _trace(gpu):
    t = {
        0: Tensor(0, (8, 8), "float32", 1e6, "input"),
        1: Tensor(1, (8, 8), "float32", 4e6, "weight"),
        2: Tensor(2, (8, 8), "float32", 1e6, "activation"),
        3: Tensor(3, (8, 8), "float32", 4e6, "gradient"),
    }
    ops = [
        Operator(0, "aten::linear", "fc", "forward", 1e-3, (0, 1), (2,), 1e9),
        Operator(1, "AddmmBackward0", "fc", "backward", 1e-3, (2, 0), (3,), 2e9, fwd_id=0),
    ]
    return Trace(ops, t, {"batch_size": 8, "gpu": gpu}).validate()


def _peak(gpu, **memory):
    cfg = {"num_gpus": 1, "batch_size": 8, "parallelism": {"mode": "single"}, "memory": memory}
    return Simulation(cfg, trace=_trace(gpu)).run()


@pytest.mark.parametrize("gpu", ["H100-SXM", "A100-80GB"])
def test_the_peak_holds_the_workspaces_all_run_long(gpu):
    # by hand: weights 4e6, SGD (no states); during the backward op the input and the
    # activation, 2e6 (6e6 in all); at its end the 4e6 gradient exists and both are freed:
    # 8e6, the peak without workspaces; plus the workspaces
    r = _peak(gpu)
    ws = {"H100-SXM": 64 * MIB, "A100-80GB": 2 * 8_519_680}[gpu]
    assert r.peak_memory[0] == 8e6 + ws
    m = r.memory
    assert (m["buffers"] == ws).all()  # from the first instant to the last
    assert _peak(gpu, workspace=0).peak_memory[0] == 8e6
    assert _peak(gpu, workspace=12345).peak_memory[0] == 8e6 + 12345  # the config's
    assert _peak(None).peak_memory[0] == 8e6  # no GPU: a CPU measurement's terms
