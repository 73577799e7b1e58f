"""Memory PyTorch's math libraries hold for the whole run, outside every tensor: the cuBLAS
workspaces, which `torch.cuda.max_memory_allocated` counts (they come from the caching
allocator) and which the trace's tensor table does not list.

PyTorch (aten/src/ATen/cuda/CublasHandlePool.cpp, 2.x): each (cuBLAS handle, stream) pair
gets a workspace from the caching allocator on its first matrix product and keeps it: 32 MiB
(4096 KiB x 8) on compute capability 9.0 (Hopper), else ":4096:2:16:8" = 4096 KiB x 2 +
16 KiB x 8 = 8,519,680 bytes; CUBLAS_WORKSPACE_CONFIG overrides both. cuBLASLt shares it
(TORCH_CUBLASLT_UNIFIED_WORKSPACE is on by default). Handles are per thread, and a training
step multiplies matrices on two threads: the loop's (forward) and autograd's device thread
(backward), so one stream holds two workspaces: 64 MiB on an H100.

Measured (docs/memory.md): at the step's start every real H100/H200 trace holds 66.1 to
90.5 MiB more than its weights, gradients, Adam states and inputs.
"""

from __future__ import annotations

MIB = 2**20
HOPPER = 4096 * 1024 * 8  # bytes, PyTorch's default on compute capability 9.0
OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8  # bytes, its default elsewhere (":4096:2:16:8")
THREADS = 2  # handles that multiply matrices in a training step: the loop's, autograd's


def cublas_workspace(compute_capability: tuple[int, int] | None) -> int:
    """Bytes of one of PyTorch's default cuBLAS workspaces on a GPU of this capability."""
    return HOPPER if tuple(compute_capability or ()) == (9, 0) else OTHER


def library_bytes(gpu_name: str | None) -> float:
    """Bytes each GPU of a run on `gpu_name` holds in library workspaces: THREADS cuBLAS
    workspaces of that GPU, and 0 where the run names no GPU from the catalogue (a CPU
    trace simulated without `gpu`: its measured peak had no cuBLAS). The config's
    `memory.workspace`, where given, replaces this (triosim.simulation.wiring)."""
    if not gpu_name:
        return 0.0
    from triosim.common.errors import ConfigError
    from triosim.hardware import catalogue as hardware

    try:
        g = hardware.gpu(gpu_name)
    except ConfigError:
        return 0.0
    return float(THREADS * cublas_workspace(g.compute_capability))
