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
    """A GPU's spec-sheet figures. `peak_flops`: per math mode, the dense peak of the units a
    matrix product or convolution in that mode runs on (tensor cores for tf32, float16,
    bfloat16, float8; the CUDA cores for float32, which PyTorch runs there with TF32 off).
    `vector_flops`: per dtype, the CUDA cores' peak (element-wise work, normalisation,
    reductions: no tensor cores). `sms`, `boost_clock` (Hz) and `l2_bytes` are recorded for
    comparisons between GPUs (what differs between two GPUs and what does not); the time
    models use the peaks and the bandwidth."""

    name: str
    peak_flops: dict[str, float]  # math mode -> dense FLOP/s of the units that run it
    memory_bandwidth: float  # bytes/s
    memory_capacity: float  # bytes
    aliases: tuple[str, ...] = field(default=())
    vector_flops: dict[str, float] = field(default_factory=dict)  # dtype -> CUDA-core FLOP/s
    sms: int | None = None
    boost_clock: float | None = None  # Hz
    l2_bytes: float | None = None
    # CUDA compute capability (NVIDIA, "CUDA GPUs - Compute Capability": A100 8.0, A40 8.6,
    # H100 and H200 9.0); PyTorch sizes its cuBLAS workspace by it (triosim.results.workspaces)
    compute_capability: tuple[int, int] | None = None

    def flops_for(self, dtype: str = "float32") -> float:
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ConfigError(
                "dtype", dtype, f"one of {sorted(self.peak_flops)} for {self.name}"
            ) from None

    def vector_flops_for(self, dtype: str = "float32") -> float:
        """The CUDA cores' peak for `dtype` (tf32 is a tensor-core mode: its element-wise
        work runs in float32); the float32 peak where the sheet gives none for `dtype`."""
        d = "float32" if dtype == "tf32" else dtype
        if d in self.vector_flops:
            return self.vector_flops[d]
        return self.vector_flops.get("float32") or self.flops_for("float32")


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds


GPUS: dict[str, GPU] = {}
LINKS: dict[str, Link] = {}


def _gpu(g: GPU):
    # one source for what depends on the architecture (NCCL's tables, cuBLAS's workspace):
    # a GPU enters the catalogue with its compute capability
    if g.compute_capability is None:
        raise ValueError(f"catalogue GPU {g.name} needs its compute_capability")
    GPUS[g.name] = g


# NVIDIA A40 datasheet (2021): FP32 37.4 TF, TF32 74.8 TF, FP16/BF16 tensor 149.7 TF (dense),
# 48 GB GDDR6, 696 GB/s. NVIDIA Ampere GA102 whitepaper (v2.1): 84 SMs, boost 1,740 MHz,
# 6 MB L2; non-tensor FP16/BF16 at the FP32 rate (37.4 TF).
_gpu(
    GPU(
        "A40",
        {"float32": 37.4 * T, "tf32": 74.8 * T, "float16": 149.7 * T, "bfloat16": 149.7 * T},
        696 * GB,
        48 * GB,
        vector_flops={"float32": 37.4 * T, "float16": 37.4 * T, "bfloat16": 37.4 * T},
        sms=84,
        boost_clock=1740e6,
        l2_bytes=6 * 2**20,
        compute_capability=(8, 6),
    )
)
# NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: FP64 9.7 TF, FP32 19.5 TF, TF32 156 TF,
# FP16/BF16 312 TF (dense); 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s. NVIDIA A100
# Tensor Core GPU Architecture whitepaper (2020), table 1: 108 SMs, boost 1,410 MHz, 40 MB L2;
# non-tensor FP16 78 TF, BF16 39 TF, FP64 9.7 TF.
_A100 = {
    "float64": 9.7 * T,
    "float32": 19.5 * T,
    "tf32": 156 * T,
    "float16": 312 * T,
    "bfloat16": 312 * T,
}
_A100_VECTOR = {"float64": 9.7 * T, "float32": 19.5 * T, "float16": 78 * T, "bfloat16": 39 * T}
_A100_CHIP = dict(
    vector_flops=_A100_VECTOR,
    sms=108,
    boost_clock=1410e6,
    l2_bytes=40 * 2**20,
    compute_capability=(8, 0),
)
_gpu(GPU("A100-40GB", _A100, 1555 * GB, 40 * GB, ("A100",), **_A100_CHIP))
_gpu(GPU("A100-80GB", _A100, 2039 * GB, 80 * GB, **_A100_CHIP))
# NVIDIA H100 Tensor Core GPU datasheet, SXM5: FP64 34 TF, FP32 67 TF, TF32 494.7 TF,
# FP16/BF16 989.4 TF, FP8 1,978.9 TF (dense = half the "with sparsity" figures); 80 GB HBM3, 3.35 TB/s.
# NVIDIA H100 Tensor Core GPU Architecture whitepaper (v1.04), table 3 (SXM5): 132 SMs, boost
# 1,980 MHz for the figures above (FP32: 132 x 128 x 2 x 1.98 GHz = 66.9 TF), 50 MB L2;
# non-tensor FP16/BF16 133.8 TF, FP64 33.5 TF (34 on the datasheet).
_H100 = {
    "float64": 34 * T,
    "float32": 67 * T,
    "tf32": 494.7 * T,
    "float16": 989.4 * T,
    "bfloat16": 989.4 * T,
    "float8": 1978.9 * T,
}
_H100_VECTOR = {"float64": 34 * T, "float32": 67 * T, "float16": 133.8 * T, "bfloat16": 133.8 * T}
_H100_CHIP = dict(
    vector_flops=_H100_VECTOR,
    sms=132,
    boost_clock=1980e6,
    l2_bytes=50 * 2**20,
    compute_capability=(9, 0),
)
_gpu(GPU("H100-SXM", _H100, 3350 * GB, 80 * GB, ("H100", "NVIDIA H100 80GB HBM3"), **_H100_CHIP))
# NVIDIA H200 Tensor Core GPU datasheet, SXM: the same FP64/FP32/TF32/FP16/BF16/FP8 figures as
# the H100 SXM (the same GH100 chip: 132 SMs, the same clocks and 50 MB L2, which the measured
# H200 confirms: torch reports 132 SMs); 141 GB HBM3e at 4.8 TB/s: only the memory differs.
_gpu(GPU("H200", _H100, 4800 * GB, 141 * GB, ("H200-SXM", "NVIDIA H200"), **_H100_CHIP))
# NVIDIA H800 datasheet (2023), SXM: an H100 SXM for export, its NVLink cut to 400 GB/s per GPU
# (200 GB/s per direction; set it in the topology) and FP64 to 1 TF; FP32, TF32, FP16/BF16
# and FP8 as the H100 SXM's; 80 GB HBM3 at 3.35 TB/s.
_gpu(
    GPU(
        "H800-SXM",
        {**_H100, "float64": 1 * T},
        3350 * GB,
        80 * GB,
        ("H800",),
        **{**_H100_CHIP, "vector_flops": {**_H100_VECTOR, "float64": 1 * T}},
    )
)
# NVIDIA H100 Tensor Core GPU datasheet, PCIe column: FP64 26 TF, FP32 51 TF, TF32 756 TF,
# FP16/BF16 1,513 TF, FP8 3,026 TF with sparsity (dense: half), 80 GB HBM2e at 2 TB/s,
# 300-350 W. H100 architecture whitepaper (v1.04), table 3, PCIe: 114 SMs, boost 1,755 MHz
# (FP32: 114 x 128 x 2 x 1.755 GHz = 51.2 TF), 50 MB L2, non-tensor FP16/BF16 102.4 TF.
_gpu(
    GPU(
        "H100-PCIe",
        {
            "float64": 26 * T,
            "float32": 51 * T,
            "tf32": 378 * T,
            "float16": 756.5 * T,
            "bfloat16": 756.5 * T,
            "float8": 1513 * T,
        },
        2000 * GB,
        80 * GB,
        ("NVIDIA H100 PCIe",),
        vector_flops={
            "float64": 26 * T,
            "float32": 51 * T,
            "float16": 102.4 * T,
            "bfloat16": 102.4 * T,
        },
        sms=114,
        boost_clock=1755e6,
        l2_bytes=50 * 2**20,
        compute_capability=(9, 0),
    )
)
# NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column (per GPU): FP64 30 TF, FP32 60 TF,
# TF32 835 TF, FP16/BF16 1,671 TF, FP8 3,341 TF with sparsity (dense: half), 94 GB HBM3 at
# 3.9 TB/s, 350-400 W; the GH100's 132 SMs and 50 MB L2 (its clock: not on the sheet).
_gpu(
    GPU(
        "H100-NVL",
        {
            "float64": 30 * T,
            "float32": 60 * T,
            "tf32": 417.5 * T,
            "float16": 835.5 * T,
            "bfloat16": 835.5 * T,
            "float8": 1670.5 * T,
        },
        3900 * GB,
        94 * GB,
        ("NVIDIA H100 NVL",),
        vector_flops={"float64": 30 * T, "float32": 60 * T},
        sms=132,
        l2_bytes=50 * 2**20,
        compute_capability=(9, 0),
    )
)
# NVIDIA HGX B200 (Blackwell, 1,000 W): the NVIDIA Blackwell architecture technical brief's
# HGX B200 column: FP64 40 TF, FP32 80 TF, TF32 1.1 PF, FP16/BF16 2.25 PF, FP8 4.5 PF (dense:
# half the "with sparsity" 2.2, 4.5 and 9 PF); the DGX B200 datasheet: 1,440 GB of HBM3e at
# 64 TB/s for 8 GPUs, i.e. 180 GB at 8 TB/s a GPU, NVLink 5 at 1.8 TB/s a GPU (900 GB/s each
# way). Compute capability 10.0 (NVIDIA, "CUDA GPUs"); 148 SMs (two dies of 74, as CUDA
# reports them). NCCL's per-architecture constants this project holds stop at Hopper: a B200
# takes Hopper's rows of the latency and LL tables (nccl_constants.table_index: the nearest
# below), the default channel speed of the ring search on an NVSwitch node (20 GB/s, of
# INTRA_CHANNEL_SPEED) and no LL128 (LL128_ARCHS); NCCL's own sm100 figures (40.1 GB/s per
# NVLink, its search speeds) are not modelled, an assumption.
_gpu(
    GPU(
        "B200",
        {
            "float64": 40 * T,
            "float32": 80 * T,
            "tf32": 1100 * T,
            "float16": 2250 * T,
            "bfloat16": 2250 * T,
            "float8": 4500 * T,
        },
        8000 * GB,
        180 * GB,
        ("HGX-B200", "NVIDIA B200"),
        vector_flops={"float64": 40 * T, "float32": 80 * T},
        sms=148,
        compute_capability=(10, 0),
    )
)

# PCI-SIG: PCIe 4.0 x16 is 16 GT/s x 16 lanes, ~32 GB/s per direction; PCIe 5.0 doubles it.
LINKS["pcie4"] = Link("pcie4", 32 * GB, 1e-6)  # latency: assumption, ~1 us per hop
LINKS["pcie5"] = Link("pcie5", 64 * GB, 1e-6)  # latency: assumption
# NVIDIA A100 datasheet: NVLink 3, 600 GB/s total per GPU = 300 GB/s per direction.
LINKS["nvlink3"] = Link("nvlink3", 300 * GB, 0.7e-6)  # latency: assumption
# NVIDIA H100 datasheet: NVLink 4, 900 GB/s total per GPU = 450 GB/s per direction.
LINKS["nvlink4"] = Link("nvlink4", 450 * GB, 0.7e-6)  # latency: assumption
# NVIDIA DGX B200 datasheet: NVLink 5, 1.8 TB/s total per GPU = 900 GB/s per direction.
LINKS["nvlink5"] = Link("nvlink5", 900 * GB, 0.7e-6)  # latency: assumption
# NVIDIA ConnectX-6 / ConnectX-7: InfiniBand HDR 200 Gb/s, NDR 400 Gb/s per port.
LINKS["ib-hdr"] = Link("ib-hdr", 25 * GB, 2e-6)  # latency: assumption (switch + NIC)
LINKS["ib-ndr"] = Link("ib-ndr", 50 * GB, 2e-6)  # latency: assumption
# The original TrioSim's default GPU-to-GPU link (its sample configuration), for comparisons.
LINKS["triosim-default"] = Link("triosim-default", 65 * GB, 0.0)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


_found: dict = {}  # normalized name -> the GPU the scan below found for it


def gpu(name: str) -> GPU:
    """Look up a GPU by name or alias (case-insensitive)."""
    want = _norm(str(name))
    g = _found.get(want)
    # the GPU found before, while it is still the one under its name (a GPU registered
    # since comes after it in the scan; one replaced or removed is looked up again): the
    # models ask once per operator, and the scan was a tenth of a 1,024-GPU run's set-up
    if g is not None and GPUS.get(g.name) is g:
        return g
    for g in GPUS.values():
        if want in (_norm(g.name), *map(_norm, g.aliases)):
            _found[want] = g
            return g
    raise ConfigError("gpu", name, f"one of {', '.join(GPUS)} (or a GPU of your own under `gpus:`)")


def link(name: str) -> Link:
    want = _norm(str(name))
    if want in LINKS:
        return LINKS[want]
    raise ConfigError("link", name, f"one of {', '.join(LINKS)}")
