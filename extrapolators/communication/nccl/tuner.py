"""NCCL's tuner (ncclTopoTuneModel and ncclTopoGetAlgoTime, src/graph/tuning.cc, and the
channel rule of src/enqueue.cc, v2.23.4): for every enabled (algorithm, protocol) a
latency and an algorithm bandwidth; NCCL runs the pair with the least
`latency + bytes / bandwidth`. Written from the published formulas; numbers in
triosim.hardware.nccl_constants. Units as NCCL's: us, GB/s, bytes.

What NCCL's graph search would find is the input (`Graphs`): the ring graph's bus
bandwidth (channels x per-channel speed), the NVLS graph's, the network's, and how many
graph channels there are. extrapolators.communication.nccl.model derives them from the topology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from triosim.hardware import nccl_constants as P

COLL = {
    "allreduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
}


@dataclass(frozen=True)
class Graphs:
    n: int  # ranks
    N: int  # nodes
    arch: int  # compute capability (70, 80, 90)
    intra_hw: str  # 'nvlink' or 'pcie'
    ring_bw: float  # ring graph: channels x per-channel speed, GB/s
    # ring/tree graph channels, a continuous count (extrapolators.communication.nccl.model says why): NCCL's
    # whole number where the ring's bandwidth is a whole number of channel speeds
    channels: float
    nvls_bw: float = 0.0  # NVLS graph: heads x speed, GB/s (0: no NVLS)
    net_bw: float = 0.0  # network: NICs x per-channel speed, GB/s
    rails: int = 1  # NICs (heads) per node
    collnet: bool = False  # in-network reduction between nodes (IB SHARP)
    cpu: str = "intel"
    latency_inter: float = 0.0  # graph latencyInter, us

    @property
    def ppn(self) -> float:
        return self.n / self.N

    def runtime_channels(self) -> float:
        """connect.cc: the runtime uses twice the graph's channels (at most 32)."""
        return min(P.MAX_CHANNELS, 2 * self.channels)


def _log2i(x: float) -> int:
    return int(math.floor(math.log2(x))) if x >= 1 else 0


def _idx2(N: int) -> int:
    return 0 if N == 1 else 1 if N == 2 else 2


def enabled(g: Graphs, op: str, protocol: str | None = None) -> list[tuple[str, str]]:
    """The (algorithm, protocol) pairs NCCL would consider for `op` by default, or with
    only `protocol` enabled, as NCCL_PROTO does (which enables LL128 where NCCL would not
    by default: PCIe, older GPUs)."""
    ll128 = g.arch in P.LL128_ARCHS and g.intra_hw == "nvlink"
    protos = [protocol] if protocol else [p for p in P.PROTOS if p != "LL128" or ll128]
    pairs = [("ring", p) for p in protos]
    if op == "allreduce" and g.n > 1:
        pairs += [("tree", p) for p in protos]
        simple = "Simple" in protos  # NVLS and CollNet run the Simple protocol only
        if simple and g.nvls_bw > 0 and g.arch >= P.NVLS_MIN_ARCH:
            pairs.append(("nvls", "Simple") if g.N == 1 else ("nvls_tree", "Simple"))
        if simple and g.collnet and g.N > 1:
            pairs.append(("collnet_direct", "Simple"))
    return pairs


def model(g: Graphs, op: str, algo: str, proto: str, ll_cap: bool = True) -> tuple[float, float]:
    """(latency us, algorithm bandwidth GB/s) of one pair, as ncclTopoTuneModel computes it.
    `ll_cap=False` leaves out LL's whole-GPU cap (llMaxBws), for a call on few channels."""
    n, N, ppn = g.n, g.N, g.ppn
    p = P.PROTOS.index(proto)
    ai = P.table_index(g.arch)
    i2 = _idx2(N)
    ll_row = ai if N == 1 else (1 if g.cpu == "amd" else 0)
    ll_max = P.LL_MAX_BW[ll_row][i2] if ll_cap else math.inf
    nsteps = (
        2 * (n - 1) if op == "allreduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
    )

    if algo in ("ring", "tree"):
        bus = g.ring_bw
    elif algo == "nvls":
        bus = g.nvls_bw
    elif algo == "nvls_tree":
        bus = min(g.nvls_bw, g.net_bw if N <= 2 else g.net_bw / 2)
    else:  # collnet_direct
        bus = g.net_bw
    if algo == "ring" and proto == "LL":
        bus = min(ll_max, bus * 0.5)
    if algo == "ring" and proto == "LL128":
        bus = min(bus * 0.92, g.channels * P.PER_CH_MAX_RING_LL128_BW[ai][i2])
    if algo == "tree" and op == "allreduce":
        bus = min(bus * 0.92, g.channels * P.PER_CH_MAX_TREE_BW[ai][i2])
    if algo == "tree" and proto == "LL":
        bus = min(bus / 3.8, ll_max)
    if algo == "tree" and proto == "LL128":
        bus = min(
            bus * (7 / 9 if N == 1 else 120 / 128), g.channels * P.PER_CH_MAX_TREE_LL128_BW[ai][i2]
        )
    if algo == "collnet_direct":
        f = ppn / max(g.rails, 1)  # GPUs per NIC
        bus /= f - (f - 1) / 2
        if g.arch >= 90:
            bus *= 0.85
    if algo == "ring":
        bw = bus * n / nsteps
    elif algo in ("nvls", "nvls_tree"):
        bw = bus * P.NVLS_RATIO
    else:
        bw = bus * 0.5

    lat = P.BASE_LAT[algo][p]
    intra = P.HW_LAT[g.intra_hw][algo][p]
    inter = P.HW_LAT["net"]["tree" if ppn == 1 else algo][p] + g.latency_inter
    if proto == "Simple":
        inter += g.latency_inter  # the flush
    if algo == "ring":
        if op in ("broadcast", "reduce"):
            lat += P.HW_LAT[g.intra_hw if N == 1 else "net"]["ring"][p]  # channels alike
        else:
            overhead = 0.0
            if N > 1:
                overhead = P.NET_OVERHEAD[g.cpu] * (3 if proto == "Simple" else 1)
            intra = max(intra, overhead)
            n_inter = 0 if N == 1 else 2 * (N - 1) if op == "allreduce" else N - 1
            lat += (nsteps - n_inter) * intra + n_inter * inter
    elif algo == "tree":
        lat += 2 * ((n // N - 1) * intra + _log2i(N) * inter)
    elif algo == "collnet_direct":
        lat += 2 * (min(1, n // N - 1) * intra + (n // N - 1) * 0.4) + inter
    elif algo == "nvls":
        lat = intra + (inter if N > 1 else 0.0)
    elif algo == "nvls_tree":
        lat += intra + 2 * _log2i(N) * inter
    return lat, bw


def time_us(
    g: Graphs,
    op: str,
    algo: str,
    proto: str,
    nbytes: float,
    lat: float | None = None,
    bw: float | None = None,
) -> float:
    """ncclTopoGetAlgoTime: latency + bytes / bandwidth, with NCCL's two corrections."""
    if lat is None or bw is None:
        lat, bw = model(g, op, algo, proto)
    bw *= tree_correction(op, algo, proto, nbytes)
    lat *= plateau(g, op, algo, proto, nbytes)
    return lat + nbytes / (1000 * bw)


def tree_correction(op, algo, proto, nbytes) -> float:
    """Trees are slower than their model at medium sizes: NCCL's static factor."""
    if algo != "tree" or op != "allreduce":
        return 1.0
    k = _log2i(max(int(nbytes) >> 6, 1))  # NCCL: log2i(bytes >> 6), log2i(0) = 0
    return P.TREE_CORRECTION[proto][k] if 0 <= k < 23 else 1.0


def plateau(g: Graphs, op, algo, proto, nbytes) -> float:
    """Multi-node Ring/Simple all-reduce: NCCL's "plateau effect of ring" latency factor."""
    if (
        algo == "ring"
        and proto == "Simple"
        and g.N > 1
        and op == "allreduce"
        and nbytes / (g.runtime_channels() * g.n) >= 64
    ):
        return P.RING_PLATEAU if g.arch >= 80 else 1.9
    return 1.0


def choose(g: Graphs, op: str, nbytes: float, algos=None, protos=None):
    """NCCL's pick: (algorithm, protocol) with the least time among the enabled pairs
    (restricted to `algos` / `protos` when given, as NCCL_ALGO / NCCL_PROTO do)."""
    best = None
    for algo, proto in enabled(g, op):
        if (algos and algo not in algos) or (protos and proto not in protos):
            continue
        lat, bw = model(g, op, algo, proto)
        if bw <= 0:
            continue
        t = time_us(g, op, algo, proto, nbytes, lat, bw)
        if best is None or t < best[2]:
            best = (algo, proto, t)
    return best


def channels_used(
    g: Graphs, op: str, algo: str, proto: str, nbytes: float, runtime: int | None = None
) -> tuple[float, float]:
    """(channels a call of this size runs on, channels available): enqueue.cc drops
    channels while bytes < channels x threads x threshold, so a call runs on the largest
    whole number of channels its bytes fill, at least one (NVLS always uses 16)."""
    if algo in ("nvls", "nvls_tree"):
        return P.NVLS_CHANNELS, P.NVLS_CHANNELS
    full = runtime or g.runtime_channels()
    nt = P.MAX_THREADS[proto]
    if proto == "Simple" and algo == "ring" and g.intra_hw == "pcie":
        # tuning.cc: 256 threads where the ring graph is no faster than PCI_BW; by the link
        # kind, not the number, so that a slower link never gets more channels
        nt = 256
    thr = P.THREAD_THRESHOLD[proto] * (g.n if algo == "ring" and proto == "LL" else 1)
    return min(full, max(1, int(nbytes // (nt * thr)))), full
