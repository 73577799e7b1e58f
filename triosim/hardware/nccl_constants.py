"""NCCL's tuning constants, as NCCL 2.23.4 ships them, for the NCCL collective model.

Source unless noted: github.com/NVIDIA/nccl at tag v2.23.4-1, src/graph/tuning.cc
(baseLat, hwLat, llMaxBws, perChMax*Bws, treeCorrectionFactor, the NET overhead and the
tuning formulas), src/include/comm.h (thread thresholds), src/include/device.h (thread
counts), src/graph/topo.h (NVLink and PCIe bandwidths NCCL assumes), src/graph/search.cc
(per-channel speeds), src/transport/nvls.cc (NVLS channels). Units as in NCCL:
microseconds and GB/s (1e9 B/s); the model converts. Numbers marked [derived] follow from
these (see docs/communication.md).
"""

from __future__ import annotations

NCCL_VERSION = "2.23.4"
SOURCE = "NVIDIA/nccl v2.23.4-1 src/graph/tuning.cc"

ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree")
PROTOS = ("LL", "LL128", "Simple")

# baseLat[algo][proto], us
BASE_LAT = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "collnet_direct": (0.0, 0.0, 0.0),
    "collnet_chain": (0.0, 0.0, 0.0),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
}

# hwLat[hw][algo][proto], us per hop: hw 'nvlink' when the algorithm's intra-node graph is
# NVLink, else 'pcie'; 'net' for inter-node hops. (fmt: skip below: a table of numbers reads
# better aligned, one hardware and its algorithms a block, as tuning.cc lays it out.)
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4),
               "collnet_direct": (0, 0, 3.7), "collnet_chain": (0, 0, 2.8),
               "nvls": (0, 0, 25.0), "nvls_tree": (0, 0, 25.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7),
             "collnet_direct": (0, 0, 3.7), "collnet_chain": (0, 0, 2.8),
             "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0),
            "collnet_direct": (0, 0, 31.0), "collnet_chain": (0, 0, 30.0),
            "nvls": (0, 0, 18.0), "nvls_tree": (0, 0, 14.0)},
}  # fmt: skip

ARCH_INDEX = {70: 0, 80: 1, 90: 2}  # Volta, Ampere, Hopper rows of the tables below

# llMaxBws[row][N1, N2, N>2], GB/s bus bandwidth cap of LL. One node: the row is the GPU
# (Volta, Ampere, Hopper); several nodes: the row is the CPU (0 Intel, 1 AMD).
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0))
PER_CH_MAX_RING_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7))
PER_CH_MAX_TREE_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0))
PER_CH_MAX_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0))

# treeCorrectionFactor[proto][log2(bytes / 64)], 64 B ... 256 MiB (fmt: skip below: a table of
# numbers reads better aligned, 20 to a row)
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9),
}  # fmt: skip

NET_OVERHEAD = {"intel": 1.0, "amd": 2.0}  # us per inter-node ring step (x3 for Simple)
RING_PLATEAU = 1.4  # multi-node Ring/Simple all-reduce latency factor on sm80+ (1.9 below)
NVLS_RATIO = 5.0 / 6.0  # NVLS / NVLSTree: algorithm bandwidth = bus bandwidth x 5/6

# enqueue.cc channel and thread rule: fewer channels while bytes < nc * nt * threshold
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}  # comm.h; Ring/LL: x nRanks
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}  # device.h
NVLS_CHANNELS = 16  # NCCL_NVLS_NCHANNELS default (transport/nvls.cc)
MAX_CHANNELS = 32

# What NCCL believes a link carries (topo.h, search.cc) against the hardware's spec sheet:
# NVLink 20 GB/s per link on sm70/sm80 and 20.6 on sm90 against 25 GB/s per link per
# direction; the ring graph NCCL then finds on an NVSwitch node is 12 channels x 20 GB/s
# (A100, 240 of 300 GB/s) or 12 x 30 (H100, 360 of 450) [derived]: 80 % of the line rate.
# PCIe: PCI_BW 12 GB/s for a Gen3 x16 link (15.75 GB/s). Network: at most 48 GB/s per
# channel (speedArrayInter) on a 400 Gb/s (50 GB/s) NIC, 24 of 25 on 200 Gb/s: 96 %.
LINK_EFFICIENCY = {"nvlink": 0.8, "pcie": 12.0 / 15.75, "net": 0.96}
# per-channel speed of the ring graph NCCL finds on one NVSwitch node [derived]
INTRA_CHANNEL_SPEED = {70: 20.0, 80: 20.0, 90: 30.0}
LL128_ARCHS = (70, 80, 90)  # LL128 is on by default only on these (and with NVLink)
NVLS_MIN_ARCH = 90

DEFAULT_ARCH = 80  # a trace without a catalogue GPU (a CPU trace's 'cpu', an unknown name)


def arch_of(gpu: str | None) -> int:
    """NCCL's architecture number of a catalogue GPU: its compute capability (the
    catalogue's, one source: 8.0 -> 80, 9.0 -> 90); DEFAULT_ARCH for a name the catalogue
    does not have. A catalogue GPU without a compute capability is a catalogue defect (the
    catalogue's own check refuses it)."""
    from triosim.common.errors import ConfigError
    from triosim.hardware import catalogue as hardware

    if not gpu:
        return DEFAULT_ARCH
    try:
        g = hardware.gpu(gpu)
    except ConfigError:
        return DEFAULT_ARCH
    major, minor = g.compute_capability
    return 10 * major + minor


def table_index(arch: int) -> int:
    """Row of the per-arch tables: an sm86 or unknown GPU uses the nearest row below."""
    return ARCH_INDEX[max(a for a in ARCH_INDEX if a <= max(arch, 70))]
