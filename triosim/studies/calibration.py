"""Collectives on a config's system, without a training step: what `triosim collectives`
prints and what `triosim calibrate` fits.

`collective_times(cfg, op, sizes)` simulates each size through the config's network with
its communication model, one after another on an idle network. `calibrate(cfg, table)`
fits the NCCL model's tuning (launch overhead, latency scale, bandwidth per protocol,
pipeline cost) to a measured nccl-tests table by least squares on log time, using the
model's closed form for the free network (the same numbers the simulation produces there).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import simpy

from extrapolators.communication import comm_class
from extrapolators.communication.nccl.model import Nccl
from extrapolators.communication.nccl.options import Tuning
from networks import network_class
from networks.base import gpu_nodes
from triosim.common.errors import ConfigError
from triosim.config.loading import IN_MEMORY, Config
from triosim.hardware import nccl_tests

# what a calibration may move, and how far (launch and pipeline cost in seconds)
BOUNDS = {
    "launch_overhead": (0.0, 500e-6),
    "latency_scale": (0.1, 10.0),
    "bandwidth_scale_LL": (0.05, 5.0),
    "bandwidth_scale_LL128": (0.05, 5.0),
    "bandwidth_scale_Simple": (0.05, 5.0),
    "pipeline_overhead": (0.0, 200e-6),
}


def target_gpu(cfg: Config) -> str | None:
    """The config's GPU, else the one its trace was made on (if the trace loads)."""
    if cfg.gpu:
        return cfg.gpu
    if cfg.trace in (IN_MEMORY, ""):  # a config without a trace (collectives, a workload)
        return None
    try:
        from triosim.trace.files import load_any_trace

        return load_any_trace(cfg.trace_path()).metadata.get("gpu")
    except Exception:  # no trace, or not readable: NCCL's default architecture
        return None


def system(cfg: Config, graph=None):
    """(env, network, communication model, group of all GPUs) for a config."""
    from triosim.simulation.wiring import build_topology

    graph = slowed(cfg, graph if graph is not None else build_topology(cfg))
    env = simpy.Environment()
    net = network_class(cfg.network.kind)(env, graph, cfg.network.options)
    c = cfg.communication
    comm = comm_class(c.kind)(env, net, c.options, gpu=target_gpu(cfg), base_dir=cfg.base_dir)
    return env, net, comm, tuple(net.gpus)


def slowed(cfg: Config, graph):
    """The topology with the config's heterogeneity applied as `simulate` applies it.

    What each field means for a collective alone: `heterogeneity.bandwidth`, `links` and
    random draws with `target: bandwidth` slow links, and a collective is carried by links,
    so they apply here exactly as in Simulation (the same draws, the same slowed graph).
    `heterogeneity.compute` and random draws with `target: compute` slow a GPU's compute
    tasks only (extrapolators.execution.runtime scales ComputeRun durations by them; communication
    tasks go through the network and the communication model untouched), so in `simulate`
    they do not change a collective's time either: here they change nothing, and a warning
    names them rather than ignoring them silently."""
    het = cfg.heterogeneity
    if het.is_empty():
        return graph
    compute, bandwidth = het.factors(gpu_nodes(graph), cfg.seed)
    slow = {g: f for g, f in compute.items() if f != 1.0}
    if slow:
        fields = (["heterogeneity.compute"] if het.compute else []) + [
            f"heterogeneity.random[{k}] (target: compute)"
            for k, r in enumerate(het.random)
            if r.target == "compute"
        ]
        warnings.warn(
            f"{' and '.join(fields)}: a slower compute on {len(slow)} GPU(s) does "
            "not change a collective's time (compute factors slow compute tasks "
            "only, in simulate too), so it is not applied here; bandwidth and link "
            "factors are",
            stacklevel=2,
        )
    if het.op_cv:
        warnings.warn(
            "heterogeneity.op_cv: operator draws slow compute tasks only, so a "
            "collective's time is the same; not applied here",
            stacklevel=2,
        )
    if het.links or any(f != 1.0 for f in bandwidth.values()):
        graph = het.apply_to_graph(graph, bandwidth)
    if het.link_cv:
        graph = het.jittered(graph, cfg.seed)
    return graph


def op_bytes(test_op: str, size: int, n: int) -> tuple[int, int, str]:
    """(bytes in nccl-tests' size column, count column, triosim op) for a requested size.
    triosim's op sizes are nccl-tests' size column (see extrapolators.communication.base)."""
    if test_op not in nccl_tests.OPS:
        raise ConfigError("--op", test_op, f"one of {', '.join(nccl_tests.OPS)}")
    nbytes, count = nccl_tests.byte_count(test_op, size, n)
    return nbytes, count, nccl_tests.OPS[test_op][0]


def collective_times(cfg: Config, test_op: str, sizes, root: int = 0, graph=None):
    """[(size bytes, count, seconds, algorithm, protocol)] simulated one after another."""
    env, net, comm, group = system(cfg, graph)
    n = len(group)
    if n < 2:
        raise ConfigError("num_gpus", n, "at least 2 GPUs for a collective")
    op = nccl_tests.OPS[test_op][0]
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise ConfigError("root", root, f"a rank of the {n} GPUs: 0 to {n - 1}")
    root_gpu = group[root]
    out = []
    for size in sizes:
        nbytes, count, _ = op_bytes(test_op, size, n)
        start = env.now
        env.process(comm.run(op, group, nbytes, tag=f"{test_op}:{size}", root=root_gpu))
        env.run()
        algo = proto = ""
        if isinstance(comm, Nccl):
            p = comm.plan(op, group, nbytes, root_gpu)
            algo, proto = p.algo, p.proto
        out.append((nbytes, count, env.now - start, algo, proto))
    return out


# -- calibration ------------------------------------------------------------------------------


def _terms(comm: Nccl, group, test_op: str, rows):
    op = nccl_tests.OPS[test_op][0]
    return [comm.terms(op, group, r.size, root=group[0]) for r in rows]


def predict(terms, tuning: Tuning) -> np.ndarray:
    return np.array([t.time(tuning) for t in terms])


def calibrate(cfg: Config, table: nccl_tests.Table, rows=None, graph=None):
    """Fit the NCCL model's tuning to `rows` of a measured table (default: all of them):
    least squares on log(predicted / measured) with a soft-L1 loss.

    Returns (tuning, report): the fitted Tuning and a dict of what was fitted and how well
    (median absolute error of the time on the fitted rows, before and after)."""
    from scipy.optimize import least_squares

    if cfg.communication.kind != "nccl":
        raise ConfigError(
            "communication.kind", cfg.communication.kind, "nccl (the model triosim calibrate fits)"
        )
    op = table.op or "all_reduce"
    if op not in nccl_tests.OPS:
        raise ConfigError("--op", op, f"one of {', '.join(nccl_tests.OPS)}")
    # start from NCCL's own figures, whatever calibration the config names
    opts = dataclasses.replace(
        cfg.communication.options,
        calibration=None,
        launch_overhead=None,
        latency_scale=None,
        bandwidth_scale=None,
        pipeline_overhead=None,
    )
    cfg = dataclasses.replace(
        cfg, communication=dataclasses.replace(cfg.communication, options=opts)
    )
    _, _, comm, group = system(cfg, graph)
    if table.ranks is not None and table.ranks != len(group):
        raise ConfigError("num_gpus", len(group), f"the measurement's rank count ({table.ranks})")
    rows = [r for r in (table.rows if rows is None else rows) if r.time > 0 and r.size > 0]
    if len(rows) < 2:
        raise ConfigError("nccl-tests log", f"{len(rows)} usable rows", "at least 2 rows to fit")
    terms = _terms(comm, group, op, rows)
    measured = np.array([r.time for r in rows])
    base = Tuning()
    names = ["launch_overhead", "latency_scale"]
    used = {t.proto for t in terms}
    names += [f"bandwidth_scale_{p}" for p in ("LL", "LL128", "Simple") if p in used]
    if any(t.depth for t in terms):
        names.append("pipeline_overhead")
    unit = np.array([1e-6 if n in ("launch_overhead", "pipeline_overhead") else 1.0 for n in names])
    x0 = np.array([getattr(base, n) for n in names]) / unit
    lo = np.array([BOUNDS[n][0] for n in names]) / unit
    hi = np.array([BOUNDS[n][1] for n in names]) / unit
    x0 = np.clip(x0, lo, hi)

    def tuning(x) -> Tuning:
        return dataclasses.replace(
            base, **{n: float(v * u) for n, v, u in zip(names, x, unit, strict=True)}
        )

    def residuals(x):
        r = np.log(predict(terms, tuning(x)) / measured)
        # a weak pull towards NCCL's own figures keeps parameters the rows cannot tell
        # apart (launch vs latency scale) where NCCL has them
        prior = 0.01 * (np.log(np.maximum(x, 1e-9) + 1) - np.log(np.maximum(x0, 1e-9) + 1))
        return np.concatenate([r, prior])

    # soft-L1: a one-off outlier row (nccl-tests' first size, a 70 us spike) pulls less
    fit = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac", loss="soft_l1", f_scale=0.05)
    fitted = tuning(fit.x)
    before = _median_error(predict(terms, base), measured)
    after = _median_error(predict(terms, fitted), measured)
    report = {
        "op": op,
        "ranks": len(group),
        "rows": len(rows),
        "fitted": names,
        "median_abs_error_before": before,
        "median_abs_error_after": after,
        "algorithms": sorted({f"{t.algo}/{t.proto}" for t in terms}),
    }
    return fitted, report


def _median_error(pred, measured) -> float:
    return float(np.median(np.abs(pred / measured - 1)))


def write_calibration(path, tuning: Tuning, report: dict, source: str = "") -> Path:
    import yaml

    from triosim.hardware import nccl_constants as nccl_params

    names = report["fitted"]
    data = {
        "tuning": {n: float(getattr(tuning, n)) for n in names},
        "fit": {
            "source": source,
            "model": f"NCCL {nccl_params.NCCL_VERSION} tuning model",
            **{k: v for k, v in report.items() if k != "fitted"},
        },
    }
    from triosim.common.outputs import write_text

    return write_text(
        path,
        "# written by `triosim calibrate`: the NCCL model's tuning for "
        "this system\n" + yaml.safe_dump(data, sort_keys=False),
    )


def errors_by_range(sizes, predicted, measured) -> dict:
    """Median absolute error of time by size range (< 1 MiB, 1-64 MiB, >= 64 MiB)."""
    out = {}
    for name, lo, hi in (
        ("<1MiB", 0, 2**20),
        ("1-64MiB", 2**20, 2**26),
        (">=64MiB", 2**26, math.inf),
    ):
        e = [
            abs(p / m - 1)
            for s, p, m in zip(sizes, predicted, measured, strict=True)
            if lo <= s < hi
        ]
        out[name] = float(np.median(e)) if e else None
    return out
