"""One simulation run: a trace, a parallelism mode, a perf model and a network in one
simpy.Environment.

`Simulation(config)` loads and checks everything it can before any simulated time passes
(the config, the trace, the topology, the perf model, the mode's plan against the trace),
so a bad input is a ConfigError at construction; `run()` then returns a Result.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
import warnings
from pathlib import Path

import simpy

from extrapolators.communication import comm_class
from extrapolators.communication.rings import ring_order
from extrapolators.execution import Runtime
from extrapolators.execution.contention import Contention, slowdown
from extrapolators.execution.symmetry import SymmetryBroken, SymmetryWarning
from extrapolators.execution.tasks import prefixed
from extrapolators.modes import extrapolator_class
from networks import network_class
from networks import topology as topo
from networks.base import gpu_nodes, validate_graph
from perfmodel import TraceTime, model_class
from perfmodel.host import HostModel
from triosim.common import schema
from triosim.common.errors import (
    ConfigError,
    DeadlockError,
    NetworkError,
    QuotientBroken,
    SimulationError,
)
from triosim.config.loading import IN_MEMORY, Config, checked, from_dict, load_config
from triosim.results.memory import capacity, check_capacity, memory_curves
from triosim.results.result import Result
from triosim.results.workspaces import library_bytes
from triosim.simulation.gc_tuning import fewer_collections
from triosim.simulation.progress import RunProgress, big_run_note
from triosim.trace.files import load_any_trace
from triosim.trace.model import Trace, no_trace

__all__ = ["Simulation", "build_topology", "load_any_trace"]


def build_topology(cfg: Config):
    """The networkx graph a config's topology section describes, overrides applied."""
    t = cfg.topology
    builder = topo.TOPOLOGIES.get(t.kind)
    g = builder(cfg.num_gpus, t.bandwidth, t.latency, t.options)
    return topo.apply_overrides(g, t.links)


def _as_config(config, trace) -> Config:
    if isinstance(config, Config):
        return checked(config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    if isinstance(config, dict):
        if trace is not None and "trace" not in config:
            config = {**config, "trace": IN_MEMORY}
        return from_dict(config)
    raise ConfigError("config", type(config).__name__, "a Config, a mapping or a YAML path")


class Simulation:
    """Wire one run together. `Simulation(config).run()` returns a Result.

    `config` is a Config, a dict (as in YAML) or a YAML path; `trace` (a Trace) and
    `topology` (a networkx graph) override the config's, and are recorded in
    `self.config` so that a saved config re-runs as it stands.
    """

    def __init__(self, config, trace: Trace | None = None, topology=None, progress: bool = False):
        cfg = _as_config(config, trace)
        self._all_flows = None  # why a symmetric run moves every copy's flows (None: by orbits)
        self._kept: dict = {}  # what one attempt of a run worked out for the next (_reuse)
        # with `progress`, a long preparation (a million-GPU topology) says what it is doing
        with (
            RunProgress(
                f"preparing {cfg.num_gpus:,} GPUs", enabled=None if progress else False
            ) as watch,
            fewer_collections(),  # (reading a trace builds a dict per operator and tensor)
        ):
            self._prepare(cfg, trace, topology, progress, watch.stage)

    def _prepare(self, cfg: Config, trace, topology, progress, stage) -> None:
        """Everything a run needs, checked: first what needs no topology (the trace, memory,
        the performance model, and above EARLY_PLAN_ABOVE GPUs the mode's checks on a
        stand-in of the plan), so that a one-line config error is not kept waiting behind a
        large topology; then the topology, the heterogeneity and the plan itself."""
        stage("loading the trace")
        if trace is None and not cfg.trace:  # mode chakra (checked at load): its own times
            trace = no_trace()
        self.trace = trace if trace is not None else load_any_trace(cfg.trace_path(), progress)
        gpu_name = cfg.gpu or self.trace.metadata.get("gpu")
        check_capacity(cfg.memory, gpu_name)
        if cfg.memory.workspace is None:  # resolved once, so every reader of the config's
            # memory options (the memory curves, a saved config) holds the same workspaces
            memory = dataclasses.replace(cfg.memory, workspace=library_bytes(gpu_name))
            cfg = dataclasses.replace(cfg, memory=memory)
        stage("building the performance model")
        p = cfg.perfmodel
        par = cfg.parallelism
        mode = extrapolator_class(par.mode)
        self.host = None  # perfmodel.host.HostModel where the host model is on
        if not mode.uses_trace:  # the workload carries its times: no operator to time
            self.model = TraceTime(self.trace)
        else:
            self.model = model_class(p.kind).from_config(
                self.trace, p.options, lambda path: load_any_trace(cfg.resolve(path))
            )
            self.model.check_target(cfg.gpu)
            self.host = HostModel.for_trace(self.trace, cfg.host)
        # compute slowed while its GPU communicates (extrapolators.execution.contention)
        self.slowdown, self.overlap = slowdown(cfg.overlap, self.trace)
        early = topology is None and cfg.num_gpus > EARLY_PLAN_ABOVE
        if early:
            stage("checking the plan")
            _check_plan_early(mode, self.trace, self.model, cfg)
            _say_if_big(cfg, progress)
        stage("building the topology")
        if topology is not None:
            self.graph = _finite_links(validate_graph(topology))
            cfg = dataclasses.replace(cfg, topology=_recorded(self.graph, cfg.topology))
        else:
            self.graph = validate_graph(build_topology(cfg))
        self.config = cfg
        self.gpus = gpu_nodes(self.graph)
        if len(self.gpus) != cfg.num_gpus:
            raise ConfigError(
                "num_gpus", cfg.num_gpus, f"the number of GPUs in the topology ({len(self.gpus)})"
            )
        het = cfg.heterogeneity
        self.compute_slowdown, bandwidth = het.factors(self.gpus, cfg.seed)
        if het.links or any(f != 1.0 for f in bandwidth.values()):
            self.graph = het.apply_to_graph(self.graph, bandwidth)
        # network jitter slows the links, not the plans: the ring hint and the mode's layout
        # are chosen on the rated links, the network runs the drawn ones (NCCL's model still
        # picks its rings on what the network has: it sees the jitter, a real NCCL would not)
        self.net_graph = het.jittered(self.graph, cfg.seed) if het.link_cv else self.graph
        stage("ordering the ring")
        ring = ring_order(self.graph, self.gpus) if len(self.gpus) > 2 else tuple(self.gpus)
        stage("planning the streams")
        self.extrapolator = mode(
            self.trace,
            self.model,
            self.gpus,
            cfg.parallelism_options(),
            batch_size=cfg.batch_size,
            gpu=cfg.gpu,
            ring=ring,
            graph=self.graph,
            host=self.host,
            precision=cfg.precision,
        )
        if not early:
            _say_if_big(cfg, progress)

    def target_gpu(self) -> str | None:
        """The GPU the run is for: the config's, else the one the trace was made on."""
        return self.config.gpu or self.trace.metadata.get("gpu")

    def run(self, progress=None) -> Result:
        """Simulate; `progress` (a triosim.simulation.progress.RunProgress) watches the run.

        With `symmetry: auto`, the representatives of the mode's classes of identical GPUs
        are simulated (extrapolators.execution.symmetry) when the conditions checkable beforehand
        hold, and the run itself checks the rest; otherwise, or when the run finds the
        replicas asymmetric, the full simulation runs and a SymmetryWarning says why.
        `result.symmetry` says which ran."""
        wall = time.perf_counter()
        self._kept = {}
        reason = "symmetry: off"
        if self.config.symmetry == "auto":
            abandoned, n, finer = False, len(self.gpus), None
            sym, reason = self._symmetry()
            while sym is not None:  # the declaration, then its coarser fallbacks
                if abandoned:  # the last attempt's environment is cycles of generators
                    gc.collect()
                try:
                    result = self._run(progress, sym, wall)
                except QuotientBroken as e:  # the same declaration, every copy's flows moved
                    self._all_flows = str(e)
                    abandoned = True
                    continue
                except (SymmetryBroken, DeadlockError) as e:
                    reason = f"the symmetric run stopped: {e}"
                    if finer is None:  # (what broke, without the hint: a summary line)
                        what = getattr(e, "message", str(e))
                        finer = f"{sym.describe(n)[len('auto: ') :]}: {what}"
                    abandoned = True
                    sym = self._first_holding(sym.fallback)[0]
                else:
                    result.symmetry = sym.describe(n)
                    if finer is not None:  # a finer declaration broke first
                        result.symmetry += f" (fell back from {finer})"
                    return result
            if abandoned:  # its environment is cycles of generators: free it before the next
                gc.collect()
            warnings.warn(
                f"symmetry: auto fell back to the full simulation: {reason}",
                SymmetryWarning,
                stacklevel=2,
            )
        result = self._run(progress, None, wall)
        result.symmetry = "off" if self.config.symmetry == "off" else f"off (fell back: {reason})"
        return result

    def _symmetry(self):
        """(the mode's Symmetry, None) when what can be checked before the run holds, else
        (None, the reason): a declaration that partitions the GPUs into classes of K >= 2,
        one iteration loop the runtime drives, equal compute factors and equal held bytes
        (weights, buffers) within every class. The streams of sampled copies are compared
        when the run starts; the network's symmetry is checked as it runs."""
        ex = self.extrapolator
        declare = getattr(ex, "symmetry", None)
        sym = declare() if declare is not None else None
        if sym is None:
            return None, f"mode '{self.config.parallelism.mode}' declares no symmetry"
        if ex.owns_iterations:
            return None, "the mode runs its iterations itself"
        het = self.config.heterogeneity
        if het.op_cv or het.link_cv:
            return None, "heterogeneity.op_cv / link_cv draw every GPU's operators and links apart"
        return self._first_holding(sym)

    def _first_holding(self, sym):
        """(`sym` or the first of its fallbacks whose checks before the run hold, None), or
        (None, why the last of them cannot stand)."""
        why = None
        while sym is not None:
            why = self._problem(sym)
            if why is None:
                return sym, None
            sym = sym.fallback
        return None, why

    def _problem(self, sym) -> str | None:
        """Why `sym` cannot stand for this run (checked before it), or None."""
        ex = self.extrapolator
        why = sym.problem(self.gpus)
        if why is None:
            why = sym.equal_within_classes(self.compute_slowdown, "the compute factor")
        if why is None:
            held = {g: (ex.held_weight_bytes(g), ex.buffer_bytes(g)) for g in self.gpus}
            why = sym.equal_within_classes(held, "(held weight bytes, buffer bytes)")
        return why

    def _by_orbits(self, sym, net, comm, runtime) -> str:
        """Let the network move one flow per orbit of the copies (networks.packet.quotient)
        where nothing rules it out: a communication model without start_many (its image
        collectives start one by one), an earlier attempt that broke it, a collective whose
        transfers the check before the run refuses. Says which it is."""
        why = self._all_flows
        if why is None and not hasattr(comm, "start_many"):
            why = "the communication model starts each copy's collective on its own"
        by_orbits = getattr(net, "by_orbits", None)
        if why is None and by_orbits is not None:
            try:  # every collective's transfers checked now, not half-way through the run
                if by_orbits(sym):
                    runtime.prepare_calls(sym.collectives, sym.sends)
                    return f"by orbits: one flow of every {sym.copies}"
            except QuotientBroken as e:
                by_orbits(None)
                comm.forget_batches()
                why = str(e)
        return f"every copy's: {why or 'this network moves every flow'}"

    def _run(self, progress, sym, wall) -> Result:
        with fewer_collections():
            return self._run_once(progress, sym, wall)

    def _run_once(self, progress, sym, wall) -> Result:
        cfg = self.config
        if hasattr(progress, "stage"):  # (a monitor may have only attach: the documented hook)
            progress.stage("setting up the network")
        env = simpy.Environment()
        net = network_class(cfg.network.kind)(env, self.net_graph, cfg.network.options)
        c = cfg.communication
        _reuse_routes(self._kept, net)
        comm = comm_class(c.kind)(env, net, c.options, gpu=self.target_gpu(), base_dir=cfg.base_dir)
        _reuse_analysis(self._kept, comm)
        runtime = Runtime(
            env,
            net,
            comm,
            compute_scale=self.compute_slowdown,
            symmetry=sym,
            host=self.host,
            noise=cfg.heterogeneity.op_noise(self.gpus, cfg.seed),
            contention=Contention(env, self.slowdown) if self.slowdown else None,
        )
        if sym is not None:  # a second set of streams: checking consumes them
            sym.check_streams(self.extrapolator.streams())
            flows = self._by_orbits(sym, net, comm, runtime)
        self._start_iterations(runtime, cfg.iterations, sym)
        if progress is not None:
            progress.attach(env, runtime)
        env.run()
        runtime.check_finished()
        if sym is not None:
            runtime.check_symmetry()
        check_conservation(runtime, net)
        if progress is not None:
            progress.stage("results")
        log = runtime.timeline()  # the table is built when asked for (Result.timeline)
        result = Result(
            rows=log,
            gpus=self.gpus,
            config=cfg,
            links=net.link_stats(),
            transfers=net.transfers_later(),
            collective_bytes=runtime.collective_bytes,
            bytes_delivered=net.bytes_delivered,
            network_stats=net.stats(),
            wall_time=time.perf_counter() - wall,
            trace=self.trace if cfg.trace == IN_MEMORY else None,
            orbits=None if sym is None else sym.orbits,
        )
        result.symmetry_skew = runtime.symmetry_skew
        result.symmetry_flows = flows if sym is not None else None
        describe = getattr(self.extrapolator, "describe", None)
        result.layout = describe() if describe is not None else None  # the mesh's degrees
        result.overlap = self.overlap
        if self.host is not None:
            result.host = self.host.describe()
        elif not extrapolator_class(cfg.parallelism.mode).uses_trace:
            result.host = "off (the workload carries its own times)"
        else:
            result.host = HostModel.off_reason(self.trace, cfg.host)
        del runtime, comm, net, env  # the event queue (the log lives on in the result)
        self._kept = {}  # (the routes and group analyses: no attempt comes after this one)
        if progress is not None:
            progress.stage("memory")
        # with symmetry: the representatives' curves, which the Result copies to their images
        # (not compared for curves to share: representatives seldom repeat one another,
        # and comparing their rows cost more than it saved; the same curves either way)
        gpu_name = cfg.gpu or self.trace.metadata.get("gpu")
        gpus = list(sym.reps) if sym else self.gpus
        mem, peaks = memory_curves(
            log, self.trace, self.extrapolator, gpus, cfg.memory, share=sym is None
        )
        result.set_memory(mem, peaks, capacity(cfg.memory, gpu_name), cfg.memory.reserve)
        return result

    def _start_iterations(self, runtime: Runtime, k_max: int, sym=None) -> None:
        """K back-to-back iterations on one network (so state such as photonic circuits
        carries over): a GPU's streams of iteration k start once all its streams of
        iteration k-1 are done (its next forward waits for its optimizer step). A mode that
        runs its iterations itself (decentralized training) gets K and no barrier. With
        `sym`, only its representatives' streams start."""
        if self.extrapolator.owns_iterations:
            for (gpu, stream), tasks in self.extrapolator.streams(iterations=k_max).items():
                runtime.start(gpu, stream, tasks)
            return
        reps = None if sym is None else sym.orbits
        previous: dict = {}
        for k in range(k_max):
            streams = self.extrapolator.streams()
            current: dict = {}
            for (gpu, stream), tasks in streams.items():
                if reps is not None and gpu not in reps:
                    continue
                after = [runtime.done_key(gpu, s, k - 1) for s in previous.get(gpu, ())]
                runtime.start(gpu, stream, prefixed(tasks, f"it{k}/") if k else tasks, k, after)
                current.setdefault(gpu, []).append(stream)
            previous = current


# errors of a stand-in plan that may come from the stand-in itself (no topology, GPUs
# numbered 0..N-1), not from the config: the real plan decides on them
_STAND_IN_FIELDS = {"parallelism.graph", "parallelism.placement", "parallelism.order"}


# above this many GPUs the plan is checked on a stand-in before the topology is built (a
# million-GPU topology takes a minute); below, the topology takes well under a second and
# the plan itself is checked right after it (the stand-in cost 0.3 s of a 2 s run)
EARLY_PLAN_ABOVE = 16_384


def _say_if_big(cfg: Config, progress) -> None:
    """The note that a run may take minutes, after the plan's checks (an error is not
    preceded by it)."""
    note = big_run_note(cfg.num_gpus, cfg.iterations) if progress else None
    if note:
        print(note, file=sys.stderr, flush=True)


def _reuse_routes(kept: dict, net) -> None:
    """A new attempt's network takes the routes the attempt before's worked out on the same
    graph (a pure function of it and the routing; `reuse_routes` checks both) and leaves
    its own for the next: a symmetric run that falls back builds a second network."""
    if kept.get("routes") is not None and hasattr(net, "reuse_routes"):
        net.reuse_routes(kept["routes"])
    kept["routes"] = getattr(net, "routes", None)


def _reuse_analysis(kept: dict, comm) -> None:
    """The same for the communication model's analysis of each group (NCCL's: a pure
    function of the graph, the routes and its options; `reuse_analysis` checks them):
    Mixtral's fallen-back run analysed its 164 groups again (0.75 s of a 5 s run)."""
    if kept.get("analysis") is not None and hasattr(comm, "reuse_analysis"):
        comm.reuse_analysis(kept["analysis"])
    kept["analysis"] = getattr(comm, "analysis", None)


def _check_plan_early(mode, trace, model, cfg: Config) -> None:
    """Run the mode's own checks (batch split, degrees, micro-batches, layer widths) on a
    stand-in of the plan, GPUs 0..N-1 with no topology, before the topology is built: at a
    million GPUs building it takes a minute, and `batch_size: 8` must not wait for it. The
    stand-in is only a preview: an error it may owe to being a stand-in (a graph or a GPU
    placement it lacks), or anything other than a ConfigError, is left to the real plan."""
    try:
        mode(
            trace,
            model,
            range(cfg.num_gpus),
            cfg.parallelism_options(),
            batch_size=cfg.batch_size,
            gpu=cfg.gpu,
            ring=None,
            graph=None,
            precision=cfg.precision,
        )
    except ConfigError as e:
        if e.field not in _STAND_IN_FIELDS:
            raise
    except Exception:  # noqa: BLE001 (the real plan, built next, reports it in context)
        pass


def _finite_links(graph):
    """A graph passed from Python: every bandwidth finite (the communication model divides
    by it and rounds; a config's topology is checked by the schema)."""
    for u, v, d in graph.edges(data=True):
        if not math.isfinite(d["bandwidth"]):
            raise NetworkError(
                f"link {u!r}->{v!r}: bandwidth must be a finite number of "
                f"bytes/s, got {d['bandwidth']!r} (for an ideal link, give a "
                "large one such as 1e15)"
            )
    return graph


def _recorded(graph, section):
    """The topology section for a graph a Python caller passed: its edge list."""
    try:
        opts = schema.load(topo.EdgesOptions, topo.to_edges(graph), "topology")
    except ConfigError:
        return section  # nodes YAML cannot name (e.g. tuples): the graph is not recorded
    return dataclasses.replace(section, kind="edges", links=[], options=opts)


def check_conservation(runtime: Runtime, net) -> None:
    """Always-on end-of-run check; a violation is a SimulationError."""
    if runtime.tasks_started != runtime.tasks_finished:
        raise SimulationError(
            f"{runtime.tasks_started} tasks started but {runtime.tasks_finished} finished"
        )
    if net.in_flight or not math.isclose(
        net.bytes_sent, net.bytes_delivered, rel_tol=1e-9, abs_tol=1e-6
    ):
        raise SimulationError(
            f"bytes sent ({net.bytes_sent}) != bytes delivered "
            f"({net.bytes_delivered}); {net.in_flight} transfers in flight"
        )
