"""Catalogue of GPUs and links. Numbers are peak dense figures from public spec sheets.

Units: FLOP/s, bytes/s, bytes, seconds. Link bandwidths are per direction.
Latencies are not on spec sheets; the values below are typical one-hop figures
and are marked as assumptions: set your own in the topology for validation work
(the TrioSim paper used nccl-tests to measure achieved bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from triosim.common.errors import ConfigError

T = 1e12
GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (tensor cores where they apply)
    memory_bandwidth: float  # bytes/s
    memory_capacity: float  # bytes
    aliases: tuple[str, ...] = field(default=())

    def flops_for(self, dtype: str = "float32") -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(
                "dtype", dtype, f"one of {sorted(self.peak_flops)} for {self.name}"
            ) from None


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds


GPUS: dict[str, GPU] = {}
LINKS: dict[str, Link] = {}


def _gpu(g: GPU):
    GPUS[g.name] = g


# NVIDIA A40 datasheet (2021): FP32 37.4 TF, TF32 74.8 TF, FP16/BF16 tensor 149.7 TF (dense),
# 48 GB GDDR6, 696 GB/s.
_gpu(
    GPU(
        "A40",
        {"float32": 37.4 * T, "tf32": 74.8 * T, "float16": 149.7 * T, "bfloat16": 149.7 * T},
        696 * GB,
        48 * GB,
    )
)
# NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: FP64 9.7 TF, FP32 19.5 TF, TF32 156 TF,
# FP16/BF16 312 TF (dense); 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s.
_A100 = {
    "float64": 9.7 * T,
    "float32": 19.5 * T,
    "tf32": 156 * T,
    "float16": 312 * T,
    "bfloat16": 312 * T,
}
_gpu(GPU("A100-40GB", _A100, 1555 * GB, 40 * GB, ("A100",)))
_gpu(GPU("A100-80GB", _A100, 2039 * GB, 80 * GB))
# NVIDIA H100 Tensor Core GPU datasheet, SXM5: FP64 34 TF, FP32 67 TF, TF32 494.7 TF,
# FP16/BF16 989.4 TF, FP8 1,978.9 TF (dense = half the "with sparsity" figures); 80 GB HBM3, 3.35 TB/s.
_H100 = {
    "float64": 34 * T,
    "float32": 67 * T,
    "tf32": 494.7 * T,
    "float16": 989.4 * T,
    "bfloat16": 989.4 * T,
    "float8": 1978.9 * T,
}
_gpu(GPU("H100-SXM", _H100, 3350 * GB, 80 * GB, ("H100", "NVIDIA H100 80GB HBM3")))
# NVIDIA H200 Tensor Core GPU datasheet, SXM: same compute as H100 SXM; 141 GB HBM3e, 4.8 TB/s.
_gpu(GPU("H200", _H100, 4800 * GB, 141 * GB, ("H200-SXM", "NVIDIA H200")))

# PCI-SIG: PCIe 4.0 x16 is 16 GT/s x 16 lanes, ~32 GB/s per direction; PCIe 5.0 doubles it.
LINKS["pcie4"] = Link("pcie4", 32 * GB, 1e-6)  # latency: assumption, ~1 us per hop
LINKS["pcie5"] = Link("pcie5", 64 * GB, 1e-6)  # latency: assumption
# NVIDIA A100 datasheet: NVLink 3, 600 GB/s total per GPU = 300 GB/s per direction.
LINKS["nvlink3"] = Link("nvlink3", 300 * GB, 0.7e-6)  # latency: assumption
# NVIDIA H100 datasheet: NVLink 4, 900 GB/s total per GPU = 450 GB/s per direction.
LINKS["nvlink4"] = Link("nvlink4", 450 * GB, 0.7e-6)  # latency: assumption
# NVIDIA ConnectX-6 / ConnectX-7: InfiniBand HDR 200 Gb/s, NDR 400 Gb/s per port.
LINKS["ib-hdr"] = Link("ib-hdr", 25 * GB, 2e-6)  # latency: assumption (switch + NIC)
LINKS["ib-ndr"] = Link("ib-ndr", 50 * GB, 2e-6)  # latency: assumption
# The original TrioSim's default GPU-to-GPU link (its sample configuration), for comparisons.
LINKS["triosim-default"] = Link("triosim-default", 65 * GB, 0.0)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def gpu(name: str) -> GPU:
    """Look up a GPU by name or alias (case-insensitive)."""
    want = _norm(str(name))
    for g in GPUS.values():
        if want in (_norm(g.name), *map(_norm, g.aliases)):
            return g
    raise ConfigError("gpu", name, f"one of {', '.join(GPUS)}")


def link(name: str) -> Link:
    want = _norm(str(name))
    if want in LINKS:
        return LINKS[want]
    raise ConfigError("link", name, f"one of {', '.join(LINKS)}")
