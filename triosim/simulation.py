"""One simulation run: a trace, a plan, a perf model and a network in one simpy.Environment."""

from __future__ import annotations

import math
import time
from pathlib import Path

import simpy

from extrapolators import Plan, Runtime, extrapolator_class
from extrapolators.collectives import ring_order
from networks import network_class
from networks import topology as topo
from perfmodel import make_model
from triosim.config import Config, from_dict, load_config
from triosim.errors import ConfigError, SimulationError
from triosim.importers import import_triosim_csv
from triosim.result import Result
from triosim.trace import Trace, load
from triosim.units import parse_bandwidth, parse_bytes, parse_seconds


def load_any_trace(path, progress: bool = False) -> Trace:
    """A triosim trace file, or a folder holding the original TrioSim trace.csv + tensor.csv."""
    path = Path(path)
    if path.is_dir() and (path / "trace.csv").exists():
        return import_triosim_csv(path)
    if path.suffix == ".csv":
        return import_triosim_csv(path)
    return load(path, progress=progress)


def _check_options(kind, builder, opts) -> None:
    import inspect

    params = list(inspect.signature(builder).parameters)[3:]  # after n, bandwidth, latency
    for k, v in opts.items():
        if k not in params:
            raise ConfigError(f"topology.{k}", v, f"an option of topology '{kind}': "
                              f"{', '.join(params) or 'none'}")  # fmt: skip
        if k in ("radix", "per_switch") and (
            isinstance(v, bool) or not isinstance(v, int) or v < 2
        ):
            raise ConfigError(f"topology.{k}", v, "an integer >= 2")


def build_topology(cfg: Config):
    t, n = cfg.topology, cfg.num_gpus
    opts = dict(t.options)
    kind = t.kind
    if kind not in topo.BUILDERS:
        raise ConfigError("topology.kind", kind, f"one of {', '.join(topo.BUILDERS)}")
    bw, lat = t.bandwidth, t.latency
    if kind in ("mesh2d", "torus2d"):
        rows = opts.pop("rows", None)
        cols = opts.pop("cols", None)
        for name, v in (("rows", rows), ("cols", cols)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"topology.{name}", v, "an integer >= 1")
        if opts:
            raise ConfigError(f"topology.{next(iter(opts))}", next(iter(opts.values())),
                              f"an option of topology '{kind}': rows, cols")  # fmt: skip
        if rows is None and cols is None:
            rows = int(math.isqrt(n))
        rows = rows or n // cols
        cols = cols or n // rows
        if rows * cols != n:
            raise ConfigError(
                "topology.rows", rows, f"rows x cols = num_gpus ({n}); got {rows} x {cols}"
            )
        g = topo.BUILDERS[kind](rows, cols, bw, lat, **opts)
    elif kind == "dgx1":
        if n != 8:
            raise ConfigError("num_gpus", n, "8 for the dgx1 topology")
        g = topo.dgx1(bw, lat)
    elif kind == "multi_node":
        per = opts.pop("gpus_per_node", 8)
        if not isinstance(per, int) or per < 1 or n % per:
            raise ConfigError(
                "topology.gpus_per_node", per, f"an integer >= 1 dividing num_gpus ({n})"
            )
        inter = parse_bandwidth(opts.pop("inter_bandwidth", "50 GB/s"), "topology.inter_bandwidth")
        inter_lat = parse_seconds(opts.pop("inter_latency", "2 us"), "topology.inter_latency")
        g = topo.multi_node(n // per, per, bw, inter, lat, inter_lat)
    elif kind == "edges":
        g = topo.from_edges(opts.pop("edges", None), bw, lat)
    else:
        _check_options(kind, topo.BUILDERS[kind], opts)
        g = topo.BUILDERS[kind](n, bw, lat, **opts)
    for k, link in enumerate(t.links):
        if not isinstance(link, dict) or "src" not in link or "dst" not in link:
            raise ConfigError(
                f"topology.links[{k}]", link, "a mapping with src, dst and bandwidth/latency"
            )
        b = link.get("bandwidth")
        la = link.get("latency")
        topo.set_link(g, link["src"], link["dst"],
                      None if b is None else parse_bandwidth(b, f"topology.links[{k}].bandwidth"),
                      None if la is None else parse_seconds(la, f"topology.links[{k}].latency"),
                      both=bool(link.get("both", False)))  # fmt: skip
    return g


_NETWORK_UNITS = {"total_bandwidth": parse_bandwidth, "setup_time": parse_seconds,
                  "latency": parse_seconds, "buffer_bytes": parse_bytes}  # fmt: skip


class Simulation:
    """Wire one run together. `Simulation(config).run()` returns a Result.

    `config` is a Config, a dict (as in YAML) or a YAML path; `trace` and `topology`
    (a networkx graph) override the config's.
    """

    def __init__(self, config, trace: Trace | None = None, topology=None, progress: bool = False):
        if isinstance(config, (str, Path)):
            config = load_config(config)
        elif isinstance(config, dict):
            if trace is not None and "trace" not in config:
                config = {**config, "trace": "<in memory>"}
            config = from_dict(config)
        self.config: Config = config
        self.trace = trace if trace is not None else load_any_trace(config.trace_path(), progress)
        self.graph = topology if topology is not None else build_topology(config)

    def run(self) -> Result:
        cfg, trace = self.config, self.trace
        wall = time.perf_counter()
        env = simpy.Environment()
        opts = {k: _NETWORK_UNITS[k](v, f"network.{k}") if k in _NETWORK_UNITS else v
                for k, v in cfg.network.options.items()}  # fmt: skip
        try:
            net = network_class(cfg.network.kind)(env, self.graph, **opts)
        except TypeError as e:
            raise ConfigError(
                "network", cfg.network.options, f"options the network takes ({e})"
            ) from None
        if len(net.gpus) != cfg.num_gpus:
            raise ConfigError("num_gpus", cfg.num_gpus,
                              f"the number of GPUs in the topology ({len(net.gpus)})")  # fmt: skip
        extra = [load_any_trace(cfg.trace_path(p)) for p in cfg.perfmodel.extra_traces]
        model_opts = dict(cfg.perfmodel.options)
        if extra:
            model_opts["extra_traces"] = extra
        try:
            model = make_model(cfg.perfmodel.kind, trace, **model_opts)
        except TypeError as e:
            raise ConfigError(
                "perfmodel", cfg.perfmodel.options, f"options the model takes ({e})"
            ) from None
        p = cfg.parallelism
        plan = Plan(mode=p.mode, num_gpus=cfg.num_gpus, batch_size=cfg.batch_size, gpu=cfg.gpu,
                    bucket_bytes=p.bucket_size, first_bucket_bytes=p.first_bucket_size,
                    microbatches=p.microbatches,
                    stages=tuple(p.stages), collective=p.collective, dp=p.dp,
                    inner=p.inner)  # fmt: skip
        gpus = net.gpus
        ring = ring_order(self.graph, gpus) if len(gpus) > 2 else tuple(gpus)
        extrapolator = extrapolator_class(p.mode)(trace, model, plan, gpus, ring)
        runtime = Runtime(env, net)
        for (gpu, stream), tasks in extrapolator.streams().items():
            runtime.start(gpu, stream, tasks)
        env.run()
        runtime.check_finished()
        result = Result(runtime.rows, net, runtime, cfg, extrapolator, time.perf_counter() - wall)
        check_invariants(result, runtime, net)
        return result


def check_invariants(result: Result, runtime: Runtime, net) -> None:
    """Always-on end-of-run checks; a violation is a SimulationError."""
    if runtime.tasks_started != runtime.tasks_finished:
        raise SimulationError(f"{runtime.tasks_started} tasks started but "
                              f"{runtime.tasks_finished} finished")  # fmt: skip
    if net.in_flight or not math.isclose(net.bytes_sent, net.bytes_delivered, rel_tol=1e-9,
                                         abs_tol=1e-6):  # fmt: skip
        raise SimulationError(f"bytes sent ({net.bytes_sent}) != bytes delivered "
                              f"({net.bytes_delivered}); {net.in_flight} transfers in flight")  # fmt: skip
    tl = result.timeline
    if len(tl):
        eps = 1e-9 * max(result.iteration_time, 1e-12)
        ordered = tl.sort_values(["gpu", "stream", "start", "end"])
        same = (ordered["gpu"].values[1:] == ordered["gpu"].values[:-1]) & (
            ordered["stream"].values[1:] == ordered["stream"].values[:-1]
        )
        overlap = same & (ordered["start"].values[1:] < ordered["end"].values[:-1] - eps)
        if overlap.any():
            k = int(overlap.argmax())
            row = ordered.iloc[k + 1]
            raise SimulationError(f"overlapping tasks on GPU {row.gpu} {row.stream} stream at "
                                  f"t={row.start}")  # fmt: skip
        busy = result.per_gpu()["compute"]
        if (busy > result.iteration_time + eps).any():
            raise SimulationError("a GPU's busy time exceeds the iteration time")
