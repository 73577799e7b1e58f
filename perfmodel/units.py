"""Which units run an operator, and so which peak bounds its compute time.

Matrix products, convolutions and attention run on the units of their math mode (the
catalogue's `peak_flops`: tensor cores for tf32, float16, bfloat16 and float8; the CUDA cores
for float32, as PyTorch runs a float32 matrix product with TF32 off, its default). Every other
operator (element-wise work, normalisation, pooling, losses, the optimizer) runs on the CUDA
cores at its dtype's rate (`vector_flops`), whatever tensor cores the GPU has.
"""

from __future__ import annotations

from triosim.hardware import catalogue as hardware

# families whose FLOPs are matrix products (perfmodel.kinds.op_kind)
MATRIX_FAMILIES = frozenset(
    {"conv", "conv_bwd", "matmul", "matmul_bwd", "attention", "attention_bwd"}
)


def compute_peak(gpu: hardware.GPU, family: str, math: str) -> float:
    """FLOP/s of the units that run an operator of `family` in math mode / dtype `math`."""
    if family in MATRIX_FAMILIES:
        return gpu.flops_for(math)
    return gpu.vector_flops_for(math)
