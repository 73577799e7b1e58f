"""The NCCL communication model (communication kind 'nccl', the default).

For each collective:
1. What NCCL would pick: extrapolators.communication.nccl.tuner runs NCCL's own cost model
   (latency + bytes / bandwidth over the enabled algorithm x protocol pairs) on the graph
   bandwidths NCCL's search would find on this topology (derived in groups.py from the links'
   bandwidths and kinds, with what NCCL believes each link kind carries:
   triosim.hardware.nccl_constants.LINK_EFFICIENCY).
2. What that costs, moving real bytes: the chosen schedule becomes streams, one network
   flow per (GPU, next GPU) of every ring, chain, tree edge or NVLS/SHARP switch leg (both
   directions of every ring, every rail, every ring of a direct-connect system), each
   carrying its share of the bytes inflated by one factor so that on the free network the
   streams finish in NCCL's `bytes / bandwidth` (protocol overheads, NCCL's caps, the
   channels a call of this size gets). Contention, heterogeneous and asymmetric links then
   act through the flow network: the slowest or busiest link decides when its stream ends,
   so a pipelined ring runs at its slowest hop, with no step barrier.
   Latency is NCCL's (baseLat + hwLat per hop, in closed form over the ring window or tree
   depth), with a hop whose links are slower than NCCL's hwLat charged its own latency
   instead; plus the launch overhead. Schedules that pipeline chunks through stages
   (NVLS, NVLS-tree, SHARP, broadcast/reduce chains) add the pipeline fill of a chunked
   pipeline with a per-chunk cost o and the best chunk count: 2 sqrt((D-1) o T) - o for
   D stages and a bandwidth time T (what NCCL's fixed formula leaves out: it is 15-40 %
   optimistic at 4-64 MiB). Rings and trees have none (a ring starts every link at once;
   trees carry NCCL's own mid-size correction).
So on an ideal topology the time is NCCL's formula (plus fill where it applies); the
calibration (triosim calibrate) scales the latency, the bandwidth per protocol and the
pipeline cost to a system's measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from extrapolators.communication.base import P2P_OPS, CommModel, check_op, register
from extrapolators.communication.nccl import families, tuner
from extrapolators.communication.nccl.groups import GroupAnalysis, _Group
from extrapolators.communication.nccl.layouts import window_max as _window_max
from extrapolators.communication.nccl.many import ManyCalls, arrivals
from extrapolators.communication.nccl.options import NcclOptions, Tuning, resolve_tuning
from extrapolators.communication.nccl.system import System, tree_depth
from networks.groups import fire_at
from triosim.common.errors import ConfigError
from triosim.hardware import nccl_constants as P

ALGO_NAMES = {
    "ring": ("ring",),
    "tree": ("tree",),
    "nvls": ("nvls", "nvls_tree"),
    "collnet": ("collnet_direct",),
}
PIPELINED = {"nvls", "nvls_tree", "collnet_direct"}
# bytes on the wire per byte of data: LL sends a 4-byte flag with every 4 bytes, LL128 one
# 8-byte flag in every 128-byte line (NCCL's device.h)
PROTO_WIRE = {"LL": 2.0, "LL128": 128 / 120, "Simple": 1.0}
# a pipelined schedule's per-chunk cost by protocol, as a share of Simple's (the tuning's
# pipeline_overhead): NCCL's per-step latency of each protocol on NVLink (hwLat, tuning.cc),
# LL's flag-per-word steps a sixth of Simple's FIFO handshake
PROTO_STEP = {
    p: P.HW_LAT["nvlink"]["ring"][i] / P.HW_LAT["nvlink"]["ring"][2] for i, p in enumerate(P.PROTOS)
}


@dataclass
class Plan:
    """One collective, ready to run: streams (src, dst, bytes on the wire), then what is
    left of latency + fill once the last stream is delivered (its path latency is paid)."""

    op: str
    algo: str
    proto: str
    nbytes: float
    streams: list
    path_latency: list  # s, each stream's path latency (the network charges it)
    latency: float  # s: launch + NCCL's latency (+ slow-link extra)
    fill: float  # s: pipeline fill
    bandwidth_time: float  # s: the streams' time on the free network
    channels: float = 0.0  # the channels the call runs on
    # the streams as the network prepared them (Network.batch), made on first run
    batch: object = field(default=None, compare=False, repr=False)
    _latencies: object = field(default=None, compare=False, repr=False)

    def latency_array(self) -> np.ndarray:
        """`path_latency` as an array (made once)."""
        if self._latencies is None:
            self._latencies = np.asarray(self.path_latency, float)
        return self._latencies

    @property
    def time(self) -> float:
        """Seconds on a free network."""
        return self.latency + self.fill + self.bandwidth_time


@dataclass
class Terms:
    """A collective's time before tuning: NCCL's latency (us) and bandwidth (GB/s) for the
    pair it picks at this size, the slow-hop extra (s), the pipeline depth (0: none)."""

    op: str
    algo: str
    proto: str
    nbytes: float
    lat_us: float
    bw: float
    extra: float
    depth: int
    channels: float
    streams: list  # (src, dst, share of the bytes)
    raw: float  # s per byte: the streams' wire bytes at the links' full bandwidth
    layout: object = field(default=None, compare=False, repr=False)  # the _Group it ran on

    def parts(self, t: Tuning) -> tuple[float, float, float]:
        """(latency, fill, bandwidth time) in seconds under tuning t."""
        scale = t.bandwidth_scale(self.proto)
        bw_time = self.nbytes / (self.bw * 1e9 * scale) if self.bw > 0 else 0.0
        bw_time = max(bw_time, self.nbytes * self.raw)  # never faster than the wires
        latency = t.launch_overhead + self.lat_us * 1e-6 * t.latency_scale + self.extra
        o = t.pipeline_overhead * PROTO_STEP[self.proto]
        fill = pipeline_fill(self.depth, o, bw_time) if self.depth else 0.0
        return latency, fill, bw_time

    def time(self, t: Tuning) -> float:
        return sum(self.parts(t))


@register("nccl")
class Nccl(CommModel):
    """The model: what it knows of each group of GPUs is groups.GroupAnalysis' (worked out
    once per group); here, per call, the (algorithm, protocol) NCCL would pick and its
    time's terms (`terms`, `plan`), and the run of a plan's streams through the network.

    Gives: CommModel's calls (`choose`, `plan`, `terms`, `predict`, `plan_uneven`, `run`,
    `run_many`) and `choices` (calls per (op, algorithm, protocol)); `analysis` (its
    GroupAnalysis), `routes` and `group_info` (the analysis'). Needs: the network it runs
    on (`batch`, `transfer_all`, and its graph and routes for the analysis) and the
    options' tuning (`resolve_tuning`)."""

    Options = NcclOptions

    def __init__(self, env, net, options=None, *, gpu=None, base_dir="."):
        super().__init__(env, net, options, gpu=gpu, base_dir=base_dir)
        o = self.options
        self.arch = P.arch_of(gpu) if o.arch == "auto" else int(o.arch[2:])
        self.tuning = resolve_tuning(o, base_dir)
        self.analysis = GroupAnalysis(net, o, self.arch)
        self.routes = self.analysis.routes
        self._plans: dict = {}
        self._uneven: dict = {}  # plan_uneven's: (group, id(sizes), algorithm) -> (sizes, plan)
        self.many = ManyCalls(self)  # run_many's calls
        self._big_kept = 0  # streams in the kept batches of more than KEEP_BATCH (_batch_of)
        self.choices: dict = {}  # (op, algo, proto) -> calls, for reports

    def reuse_analysis(self, analysis: GroupAnalysis) -> bool:
        """Take `analysis`, another model's (its groups analysed: what they are does not
        depend on the tuning or the calls), where it was made for this model's options and
        GPU architecture on the network's very graph and routes, before anything was
        planned here (a symmetric run that falls back builds a second model). Says whether
        it does."""
        a = self.analysis
        if analysis is a:
            return True
        same = (
            analysis.graph is a.graph
            and analysis.routes is getattr(self.net, "routes", None)
            and analysis.options == a.options
            and analysis.arch == a.arch
            and analysis.switch_ends == a.switch_ends
        )
        if not same or self._plans or self._uneven or self.many.calls:
            return False
        self.analysis, self.routes = analysis, analysis.routes
        return True

    def group_info(self, group) -> _Group:
        """The group's default layout, analysed (GroupAnalysis.group_info)."""
        return self.analysis.group_info(group)

    # -- the plan -------------------------------------------------------------------------
    def choose(self, op: str, group, nbytes: float, algorithm=None):
        """(algorithm, protocol) the model runs for this call, honouring the forced ones:
        NCCL's pick (or with `pick: fastest` the fastest pair) on the layout it runs on."""
        t = self.terms(op, group, nbytes, algorithm=algorithm)
        return t.algo, t.proto

    def _nccl_pick(self, info: _Group, op, nbytes, pairs) -> tuple:
        """The pair NCCL's tuner formula (extrapolators.communication.nccl.tuner) gives the least time."""
        best, best_t = None, math.inf
        for algo, proto in pairs:
            lat, bw = tuner.model(info.graphs, op, algo, proto)
            if bw <= 0:
                continue
            t = tuner.time_us(info.graphs, op, algo, proto, nbytes, lat, bw)
            if t < best_t:
                best, best_t = (algo, proto), t
        if best is None:
            raise ConfigError(
                "communication.protocol",
                self.options.protocol,
                f"a protocol NCCL can run {op} with on {info.system.group!r}",
            )
        return best

    def _pairs(self, info: _Group, op: str, algorithm=None) -> list:
        """The (algorithm, protocol) pairs NCCL would consider, restricted to the forced
        ones (a forced protocol is enabled, as NCCL_PROTO enables it); a forced pair the
        GPUs cannot run is an error, as it is in NCCL."""
        o = self.options
        name = algorithm or o.algorithm
        proto = None if o.protocol == "auto" else o.protocol
        pairs = tuner.enabled(info.graphs, op, proto)
        if name != "auto" and op == "allreduce":  # the others have the ring only
            pairs = [p for p in pairs if p[0] in ALGO_NAMES[name]]
            if not pairs and proto and tuner.enabled(info.graphs, op, None):
                if any(a in ALGO_NAMES[name] for a, _ in tuner.enabled(info.graphs, op)):
                    raise ConfigError(
                        "communication.protocol", proto, f"a protocol {name} runs (Simple only)"
                    )
            if not pairs:
                raise ConfigError("communication.algorithm", name, _missing(name, info.system))
        return pairs

    def plan(self, op: str, group, nbytes: float, root=None, algorithm=None) -> Plan:
        check_op(op)
        group = tuple(group)
        key = (op, group, float(nbytes), root, algorithm)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        if len(group) < 2:
            p = Plan(op, "none", "none", nbytes, [], [], self.tuning.launch_overhead, 0.0, 0.0)
        else:
            p = self._plan(op, group, nbytes, root, algorithm)
        if len(self._plans) < 100_000:
            self._plans[key] = p
        return p

    def terms(self, op: str, group, nbytes: float, root=None, algorithm=None) -> Terms:
        """The parts of a collective's time that do not depend on the tuning: on each of
        the group's candidate layouts that can be fastest for this call (`_candidates`),
        the pair NCCL would pick there (`choose`; with `pick: fastest` every pair), and of
        those the least time under this tuning."""
        check_op(op)
        group = tuple(group)
        a = self.analysis
        if op in P2P_OPS:
            return self._p2p_terms(a.p2p_layout(group), op, nbytes)
        fam = a.family(group)
        pairs = self._pairs(a.layout(fam, fam.default), op, algorithm)
        fastest = self.options.pick == "fastest"
        best, best_t = None, math.inf
        for k in families.candidates(fam, op, root, pairs):
            info = a.layout(fam, k)
            for algo, proto in pairs if fastest else [self._nccl_pick(info, op, nbytes, pairs)]:
                t = self._pair_terms(info, op, group, algo, proto, nbytes, root)
                if t is not None and t.time(self.tuning) < best_t:
                    best, best_t = t, t.time(self.tuning)
        return best

    def _pair_terms(self, info: _Group, op, group, algo, proto, nbytes, root) -> Terms | None:
        """`terms` of one (algorithm, protocol); None where NCCL's model gives it no
        bandwidth."""
        g = info.graphs
        lat_us, bw = tuner.model(g, op, algo, proto)
        if bw <= 0:
            return None
        runtime = None if self.options.channels == "auto" else self.options.channels
        used, full = tuner.channels_used(g, op, algo, proto, nbytes, runtime)
        if used < full:  # a small call runs on fewer channels, each at its share of the
            # links (LL's whole-GPU cap then rarely binds)
            bw = min(bw, tuner.model(g, op, algo, proto, ll_cap=False)[1] * used / full)
        bw *= tuner.tree_correction(op, algo, proto, nbytes)
        lat_us *= tuner.plateau(g, op, algo, proto, nbytes)
        skey = self._skey(op, group, algo, root)
        streams = self.analysis.structure(info, *skey)
        extra = self._slow_hop_extra(info, op, algo, proto, streams, skey)
        staged = algo in PIPELINED or op in ("broadcast", "reduce")
        depth = self._depth(info, op, algo) if staged else 0
        raw = self.analysis.stream_unit(info, skey, streams) * PROTO_WIRE[proto]
        return Terms(
            op, algo, proto, float(nbytes), lat_us, bw, extra, depth, used, streams, raw, info
        )

    def _p2p_terms(self, info: _Group, op, nbytes) -> Terms:
        """Send/receive (all-to-all, sendrecv): Simple protocol on each pair's own path, at
        what NCCL believes the link kinds carry; latency of one Simple step."""
        a = self.analysis
        skey = self._skey(op, info.system.group, "p2p")
        streams = a.structure(info, *skey)
        unit = a.stream_unit(info, skey, streams, effective=True)
        hw = "net" if info.system.N > 1 else info.system.intra_hw
        lat_us = P.BASE_LAT["ring"][2] + P.HW_LAT[hw]["ring"][2]
        bw = 1 / unit / 1e9 if unit > 0 else math.inf
        raw = a.stream_unit(info, skey, streams)
        return Terms(op, "p2p", "Simple", float(nbytes), lat_us, bw, 0.0, 0, 0, streams, raw, info)

    @staticmethod
    def _skey(op, group, algo, root=None) -> tuple:
        """The key of a collective's structure (its streams) in its group's caches."""
        if op in P2P_OPS:
            return (op, "p2p", None)
        root = root if root in group else group[0]
        return (op, algo, root if op in ("broadcast", "reduce") else None)

    def _plan(self, op, group, nbytes, root, algorithm) -> Plan:
        """The streams carry the data (LL, LL128: with their flags) capped at the rate that
        ends them all at NCCL's bandwidth time: what the GPUs can feed. Other traffic gets
        what they leave of the links."""
        terms = self.terms(op, group, nbytes, root, algorithm)
        latency, fill, bw_time = terms.parts(self.tuning)
        wire = PROTO_WIRE[terms.proto] * nbytes
        out = [(a, b, x * wire) for a, b, x in terms.streams if x * wire > 0]
        out = [(a, b, y, y / bw_time if bw_time > 0 else math.inf) for a, b, y in out]
        skey = self._skey(op, group, terms.algo, root)
        lat = self.analysis.stream_paths(terms.layout, skey, terms.streams)[0]
        kept = np.array([x for *_, x in terms.streams], float) * wire > 0  # as `out` keeps
        path_lat = lat[kept].tolist() if len(lat) else []
        return Plan(
            op,
            terms.algo,
            terms.proto,
            nbytes,
            out,
            path_lat,
            latency,
            fill,
            bw_time,
            terms.channels,
        )

    def _depth(self, info: _Group, op, algo) -> int:
        """Stages a chunk passes through one after another."""
        s = info.system
        if op in ("broadcast", "reduce"):
            return s.n - 1
        if algo == "nvls":
            return 2  # reduce-scatter through the switch, then all-gather through it
        if algo == "nvls_tree":
            return 2 + 2 * tree_depth(s.N)
        return 4  # collnet: to the node's switch, to the fabric's, and back

    def _slow_hop_extra(self, info: _Group, op, algo, proto, streams, skey) -> float:
        """Where a hop's links are slower than NCCL's per-hop latency assumes, the hop
        takes its own: the extra over NCCL's latency along the worst chain of hops."""
        s = info.system
        p = P.PROTOS.index(proto)
        intra, net = P.HW_LAT[s.intra_hw][algo][p] * 1e-6, P.HW_LAT["net"][algo][p] * 1e-6

        def excess(lat, is_net):  # max(0, path latency - NCCL's for its kind), per hop
            x = lat - np.where(is_net, net, intra)
            return np.where(x > 0.0, x, 0.0)

        if algo == "ring" and op in ("allreduce", "all_gather", "reduce_scatter"):
            steps = 2 * (s.n - 1) if op == "allreduce" else s.n - 1
            worst = 0.0
            for ways in info.ring_paths:
                for lat, is_net in ways:
                    worst = max(worst, _window_max(excess(lat, is_net), steps))
            return worst
        ex = excess(*self.analysis.stream_paths(info, skey, streams)).tolist()
        if op in ("broadcast", "reduce"):
            return sum(sorted(ex)[-(s.n - 1) :]) if ex else 0.0
        return 2 * max(ex, default=0.0)

    # -- running ----------------------------------------------------------------------------
    def predict(self, op: str, group, nbytes: float, root=None, algorithm=None) -> float:
        """Seconds the collective takes on a free network (no flows)."""
        return self.plan(op, group, nbytes, root, algorithm).time

    KEEP_BATCH = 4096  # streams up to which a plan keeps its prepared batch
    # larger batches kept too while their streams sum to at most this (a 1,024-GPU FSDP
    # group's all-gather, 16k streams, routed again at every one of its ~100 calls was 15 %
    # of the run; a kept stream costs ~200 bytes)
    KEEP_STREAMS = 262_144

    def plan_uneven(self, group, sizes, algorithm=None) -> Plan:
        """An all-to-all of uneven sizes, as NCCL runs one (grouped send/receive pairs on
        the p2p path, Simple protocol): each pair's stream at the rate the even
        all-to-all's streams get (NCCL's p2p bandwidth is per pair, not per buffer, so
        the rate does not depend on the size), the even one's latency; the call ends
        when its largest pair has arrived. algorithm "deepep" (DeepEP's dispatch and
        combine kernels, which drive NVLink and the NICs themselves): no per-pair cap,
        each stream at what the network gives it; the even one's latency; on a free
        network, the busiest GPU's bytes at the even all-to-all's per-GPU rate."""
        from extrapolators.communication.collectives import check_sizes

        group = tuple(group)
        # kept by the sizes' object (a mode passes the same table every call): a 64 x 64
        # table hashed and checked at every call cost 10 s of a 1,024-GPU MoE run
        key = (group, id(sizes), algorithm)
        cached = self._uneven.get(key)
        if cached is not None and cached[0] is sizes:
            return cached[1]
        same = self._plans.get(("all_to_all", group, sizes, algorithm))  # a new table of
        if same is not None:  # the same bytes (a Chakra replay builds one per call; a
            # mode's combine table equal to its dispatch's): kept by this object's id too,
            # or each call hashed the table again (half of DeepSeek-V3's 7,400 all-to-alls)
            if len(self._uneven) < 100_000:
                self._uneven[key] = (sizes, same)
            return same
        check_sizes(group, sizes)
        if algorithm not in (None, "deepep"):
            raise ConfigError("algorithm", algorithm, "none or deepep, for per-pair sizes")
        n = len(group)
        ref = self.plan("all_to_all", group, float(n))  # 1 byte to each peer
        rate = {(a, b): r for a, b, _, r in ref.streams}
        lat = dict(zip(((a, b) for a, b, *_ in ref.streams), ref.path_latency, strict=True))
        streams, path_lat, longest = [], [], 0.0
        for i, a in enumerate(group):
            for j, b in enumerate(group):
                y = sizes[i][j]
                if i == j or y <= 0 or (a, b) not in rate:
                    continue
                streams.append((a, b, y, math.inf if algorithm else rate[a, b]))
                path_lat.append(lat[a, b])
                longest = max(longest, y / rate[a, b])
        mean = sum(map(sum, sizes)) / n
        if algorithm:  # the busiest GPU, out or in, at the even all-to-all's rate per GPU
            out = {a: 0.0 for a in group}
            for a, b, *_ in ref.streams:
                out[a] += rate[a, b]
            longest = max(  # (a lone GPU moves nothing: no rate)
                max(sum(row) - row[i], sum(col) - col[i]) / out[group[i]] if out[group[i]] else 0.0
                for i, (row, col) in enumerate(zip(sizes, zip(*sizes, strict=True), strict=True))
            )
        p = Plan(
            "all_to_all", ref.algo, ref.proto, mean, streams, path_lat, ref.latency, 0.0, longest
        )
        if len(self._plans) < 100_000:
            self._uneven[key] = (sizes, p)  # (the sizes held: their id stays theirs)
            self._plans["all_to_all", group, sizes, algorithm] = p
        return p

    def _plan_of(self, op, group, nbytes, root=None, algorithm=None, sizes=None) -> Plan:
        """`plan`, or with per-pair `sizes` (an all-to-all only) `plan_uneven`."""
        if sizes is None:
            return self.plan(op, group, nbytes, root, algorithm)
        check_op(op)
        if op != "all_to_all":
            raise ConfigError("collective", op, "all_to_all, for per-pair sizes")
        return self.plan_uneven(group, sizes, algorithm)

    def _batch_of(self, p: Plan):
        """The plan's streams checked and routed by the network (one event for all of
        them, not one per stream: 32k at 16k GPUs); kept with the plan for small groups,
        and for large ones within KEEP_STREAMS streams in all (a machine-wide group's
        arrays cost memory: the first ones met are kept)."""
        batch = p.batch
        if batch is None:
            batch = self.net.batch(p.streams)
            n = len(p.streams)
            if n <= self.KEEP_BATCH:
                p.batch = batch
            elif self._big_kept + n <= self.KEEP_STREAMS:  # (the first ones met, kept)
                p.batch = batch
                self._big_kept += n
        return batch

    def run(self, op, group, nbytes, tag="", root=None, algorithm=None, sizes=None):
        p = self._plan_of(op, group, nbytes, root, algorithm, sizes)
        k = (op, p.algo, p.proto)
        self.choices[k] = self.choices.get(k, 0) + 1
        rest = p.latency + p.fill
        if p.streams:
            records = yield self.net.transfer_all(self._batch_of(p), tag=tag or op)
            # the network charged each stream its path latency after its last byte left;
            # NCCL's latency replaces it: wait what is left of it after the last byte left
            if len(p.streams) > 64:  # (the same float operations, in numpy)
                sent = float(np.max(arrivals(records) - p.latency_array()))
            else:
                ends = records.ends() if hasattr(records, "ends") else [r.end for r in records]
                sent = max(e - pl for e, pl in zip(ends, p.path_latency, strict=True))
            rest -= self.env.now - sent
        if rest > 0:
            yield self.env.timeout(rest)

    def run_many(self, op, groups, nbytes, tag="", roots=None, algorithm=None, sizes=None):
        """`run` of one collective over several groups at the same instant (a symmetric
        run's representatives and their images; `sizes`: an all-to-all's per-pair bytes,
        by position in each group): `start_many`, waited for. Returns each group's end
        instant; returns at the first group's end."""
        done, out = self.env.event(), []

        def then(ends, end):
            out.append(ends)
            fire_at(self.env, done, end)

        self.start_many(op, groups, nbytes, then, tag, roots, algorithm, sizes)
        yield done
        return out[0]

    def start_many(self, op, groups, nbytes, then, tag="", roots=None, algorithm=None, sizes=None):
        """`run_many`'s collective started, `then(ends, end)` called when it lands
        (many.ManyCalls.start)."""
        self.many.start(op, groups, nbytes, then, tag, roots, algorithm, sizes)

    def prepare_many(self, op, groups, nbytes, roots, algorithm=None, sizes=None) -> None:
        """What `run_many` of this call will need, made now and kept (its plans and
        batch): a symmetric run's check before it starts (networks.packet.quotient)."""
        self.many.plans(op, groups, nbytes, roots, algorithm, sizes)

    def prepare_one(self, op, group, nbytes, root=None, algorithm=None, sizes=None) -> None:
        """What `run` of this call will need, made now and kept (its plan and batch): a
        symmetric run's check before it starts (networks.packet.quotient)."""
        p = self._plan_of(op, group, nbytes, root, algorithm, sizes)
        if p.streams:
            self._batch_of(p)

    def forget_batches(self) -> None:
        """Drop the kept batches (the network now routes otherwise)."""
        self.many.forget()
        self._big_kept = 0
        for p in self._plans.values():
            p.batch = None


def _missing(name: str, s: System) -> str:
    """What a forced algorithm needs that the group's hardware lacks."""
    needs = {
        "nvls": "an NVSwitch that reduces (NVLS: `nvls: true` on the switch or "
        "multi_node topology, a Hopper GPU) under every node's GPUs, two or more a node",
        "collnet": "inter-node switches that reduce (IB SHARP: `sharp: true`), NVLS in "
        "every node and several nodes",
        "tree": "an all-reduce of two or more GPUs",
    }
    return (
        f"an algorithm the {s.n} GPUs {s.group[:8]!r}{'...' if s.n > 8 else ''} can run: "
        f"{name} needs {needs.get(name, name)} (NCCL fails where NCCL_ALGO names none "
        "the system has; use auto)"
    )


def pipeline_fill(depth: int, overhead: float, bw_time: float) -> float:
    """Extra time of a pipeline of `depth` stages over its bandwidth time T, with a cost o
    per chunk and the best number of chunks m = sqrt((D-1) T / o):
    (D-1) T/m + (m-1) o = 2 sqrt((D-1) o T) - o (one chunk, m = 1: (D-1) T)."""
    if depth <= 1 or bw_time <= 0:
        return 0.0
    if overhead <= 0:
        return 0.0
    m = math.sqrt((depth - 1) * bw_time / overhead)
    if m <= 1:
        return (depth - 1) * bw_time
    return 2 * math.sqrt((depth - 1) * overhead * bw_time) - overhead
