"""A GPU operator-time model calibrated on real GPU traces: per operator kind, a fixed time
per operator (kernel launch and tail) plus the roofline with fitted efficiencies.

    time = overhead + max(compute, memory) / efficiency                     (form "max")
    time = overhead + compute / compute_efficiency + memory / memory_efficiency  (form "sum")

compute = FLOPs / the GPU's peak for the operator's math mode; memory = bytes moved / the
GPU's memory bandwidth (bytes: the operator's distinct inputs plus its distinct outputs, an
in-place operator's tensor counted as read and written; a backward operator's bytes are
its forward operator's, so that what a tracer records as a backward operator's tensors,
which differs between tracers, does not matter; an embedding reads the rows it gathers,
not its table). Operators that launch no GPU kernel (views, empty tensors, a gradient
AccumulateGrad steals, `item` of a host scalar, the optimizer's host-side step counters,
a backward node that only passes its gradient on) take no time.

Kinds nest: an operator name ("conv2d", "Convolution" for its backward), its family
("conv", "conv_bwd"), its class ("compute": convolutions, matrix products, attention;
"memory": the rest) and "all". A kind with few samples, or samples of one size, keeps its
parent's shape and fits only a scale; an operator takes the most specific kind the table
has. A table is fitted on the traces of one GPU (`fit`) and predicts any GPU of the
catalogue with that GPU's peaks and bandwidth and the same efficiencies and overheads: an
assumption when the target is not the GPU the table was fitted on.

The shipped table (perfmodel/calibration/h100.json) is fitted on the two H100 traces of the
original TrioSim (VGG-13 and ResNet-50, batch 128); `python -m perfmodel.calibrate` refits
it. `heldout` fits on all traces but one and predicts that one, per operator kind.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from perfmodel.base import CatalogueGPUModel, Target, identity_time, register

# kinds and features live in perfmodel.kinds and perfmodel.features (re-exported here)
from perfmodel.features import PASSES, op_bytes, op_flops, op_signature, roofs  # noqa: F401
from perfmodel.kinds import COMPUTE_FAMILIES, kind_chain, launches_no_kernel, op_kind  # noqa: F401
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Operator, Trace

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
DEFAULT_GPU = "H100-SXM"
FORMS = ("max", "sum")

# -- the table ----------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Fitted parameters per kind: {"overhead": s, "compute": 1/efficiency, "memory":
    1/efficiency} (form "sum"), or {"overhead": s, "roof": 1/efficiency} (form "max")."""

    gpu: str
    form: str
    params: dict[str, dict[str, float]]
    source: str = ""
    samples: dict[str, int] = field(default_factory=dict)
    heldout: dict = field(default_factory=dict)

    def time(self, compute: float, memory: float, chain: list[str]) -> float:
        p = next((self.params[k] for k in chain if k in self.params), None)
        if p is None:
            raise ConfigError(
                "perfmodel.calibration", self.source or self.gpu, "a table with an 'all' entry"
            )
        if self.form == "max":
            return p["overhead"] + max(compute, memory) * p["roof"]
        return p["overhead"] + compute * p["compute"] + memory * p["memory"]

    def to_dict(self) -> dict:
        return {
            "format": "triosim-calibration",
            "gpu": self.gpu,
            "form": self.form,
            "source": self.source,
            "params": self.params,
            "samples": self.samples,
            "heldout": self.heldout,
        }

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")
        return path

    @classmethod
    def load(cls, path) -> Calibration:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                "perfmodel.calibration", str(path), f"a readable calibration table (JSON): {e}"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != "triosim-calibration":
            raise ConfigError(
                "perfmodel.calibration",
                str(path),
                'a calibration table ("format": "triosim-calibration")',
            )
        params = doc.get("params")
        if doc.get("form") not in FORMS or not isinstance(params, dict) or "all" not in params:
            raise ConfigError(
                "perfmodel.calibration",
                str(path),
                f"a table with form in {FORMS} and an 'all' entry",
            )
        if not isinstance(doc.get("gpu"), str):
            raise ConfigError(
                "perfmodel.calibration",
                str(path),
                "a table naming the GPU it was fitted on ('gpu')",
            )
        return cls(
            hardware.gpu(doc["gpu"]).name,
            doc["form"],
            doc["params"],
            doc.get("source", str(path)),
            doc.get("samples", {}),
            doc.get("heldout", {}),
        )


def shipped(gpu: str = DEFAULT_GPU) -> Calibration:
    """The shipped table fitted on `gpu`'s traces (only H100-SXM has one)."""
    name = hardware.gpu(gpu).name
    if name != DEFAULT_GPU:
        raise ConfigError(
            "perfmodel.calibration", name, f"a GPU with a shipped table: {DEFAULT_GPU}"
        )
    path = CALIBRATION_DIR / "h100.json"
    if not path.exists():
        raise ConfigError(
            "perfmodel.calibration",
            str(path),
            "the shipped calibration table, "
            "installed with the package (pip install -e . keeps it in place)",
        )
    return Calibration.load(path)


# -- fitting ------------------------------------------------------------------------------------


def samples(trace: Trace, gpu: hardware.GPU) -> list[tuple[list[str], float, float, float]]:
    """(kind chain, compute s, memory s, measured s) of each operator that launches a kernel
    and took time."""
    out = []
    for op in trace.operators:
        family, name = op_kind(op)
        if op.time <= 0 or launches_no_kernel(trace, op, family):
            continue
        c, m = roofs(trace, op, gpu)
        out.append((kind_chain(family, name), c, m, op.time))
    return out


def _solve(
    rows, form: str, parent: dict | None, floor: float, memory_bound: bool = False
) -> dict[str, float]:
    """Least squares of the operators' times (non-negative terms; absolute error, so the
    iteration's large operators decide the efficiencies), with the overhead at least `floor`
    (the time of a kernel that does next to nothing: small operators are never ~0). A
    memory-bound kind in form "sum" has no compute term (its FLOPs are an estimate and its
    kernels wait on memory). A kind with few operators, or operators of one size, keeps its
    parent's terms and fits one scale of them, or, when its operators are mostly overhead,
    its overhead."""
    import numpy as np
    from scipy.optimize import nnls

    c = np.array([r[0] for r in rows])
    m = np.array([r[1] for r in rows])
    t = np.array([r[2] for r in rows])
    keys = ["roof"] if form == "max" else ["compute", "memory"]
    var = [np.maximum(c, m)] if form == "max" else [c, m]
    if memory_bound and form == "sum":
        var = [np.zeros_like(c), m]
    size = np.maximum(c, m)
    spread = size.max() / max(size.min(), 1e-15) if len(t) else 1.0
    if parent is not None and (len(t) < 8 or spread < 10.0):
        base = parent["overhead"]
        v = sum(parent[k] * x for k, x in zip(keys, var, strict=True))
        den = float(np.sum(v * v))
        s = float(np.sum(v * (t - base)) / den) if den > 0 else 1.0
        if float(np.sum(v)) < base * len(t) or not 0.25 <= s <= 4.0:
            # mostly overhead, or a scale the few operators cannot vouch for: the parent's
            # terms, and the overhead fitted
            return {"overhead": max(float(np.mean(t - v)), floor), **{k: parent[k] for k in keys}}
        return {"overhead": base, **{k: parent[k] * s for k in keys}}
    a = np.vstack([np.ones_like(t), *var]).T
    norm = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)  # columns of one scale
    coef = nnls(a / norm, t)[0] / norm
    if coef[0] < floor:  # the overhead at the floor, the terms refitted
        rest = a[:, 1:] / norm[1:]
        coef = np.concatenate([[floor], nnls(rest, t - floor)[0] / norm[1:]])
    terms = {k: float(x) for k, x in zip(keys, coef[1:], strict=True)}
    return {"overhead": float(coef[0]), **terms}


def launch_floor(rows) -> float:
    """The median time of the operators whose roofline time is under 1% of their time: what
    a kernel costs that does next to nothing (launch and tail)."""
    tiny = sorted(t for _, c, m, t in rows if max(c, m) < 0.01 * t)
    return tiny[len(tiny) // 2] if tiny else 0.0


def fit(traces: list[Trace], gpu: str, form: str = "max", source: str = "") -> Calibration:
    """Fit a table on traces taken on `gpu` (measured operator times)."""
    if form not in FORMS:
        raise ConfigError("form", form, f"one of {FORMS}")
    g = hardware.gpu(gpu)
    rows = [s for t in traces for s in samples(t, g)]
    if not rows:
        raise ConfigError("traces", len(traces), "traces with timed operators")
    groups: dict[str, list] = defaultdict(list)
    for chain, c, m, t in rows:
        for key in chain:
            groups[key].append((c, m, t))
    floor = launch_floor(rows)
    params: dict[str, dict] = {"all": _solve(groups["all"], form, None, floor)}
    for level in (2, 1, 0):  # class, family, name
        for chain, *_ in rows:
            key = chain[level]
            if key not in params:
                params[key] = _solve(
                    groups[key],
                    form,
                    params[chain[level + 1]],
                    floor,
                    memory_bound=chain[2] == "memory",
                )
    ordered = {k: {p: float(f"{v:.6g}") for p, v in params[k].items()} for k in sorted(params)}
    return Calibration(
        g.name, form, ordered, source, {k: len(v) for k, v in sorted(groups.items())}
    )


def predict(
    cal: Calibration, trace: Trace, op: Operator, gpu: hardware.GPU, target: Target = Target()
) -> float:
    family, name = op_kind(op)
    if launches_no_kernel(trace, op, family):
        return 0.0
    c, m = roofs(trace, op, gpu, target)
    return cal.time(c, m, kind_chain(family, name))


def heldout(traces: dict[str, Trace], gpu: str, form: str = "max") -> dict:
    """Leave one trace out: fit on the others, predict it. Per trace: the iteration (sum of
    operator times, predicted and measured) and, per operator family, the summed times, the
    error of the sum and the median absolute error of single operators."""
    g = hardware.gpu(gpu)
    out = {}
    for name, test in traces.items():
        cal = fit([t for n, t in traces.items() if n != name], gpu, form)
        fams: dict[str, list] = defaultdict(lambda: [0.0, 0.0, []])
        for op in test.operators:
            family, _ = op_kind(op)
            p = predict(cal, test, op, g)
            if op.time <= 0 and p == 0:
                continue
            f = fams[family if family != "none" else "no kernel"]
            f[0] += op.time
            f[1] += p
            if op.time > 0:
                f[2].append(abs(p - op.time) / op.time)
        measured = math.fsum(f[0] for f in fams.values())
        predicted = math.fsum(f[1] for f in fams.values())
        out[name] = {
            "measured_ms": measured * 1e3,
            "predicted_ms": predicted * 1e3,
            "error_pct": (predicted - measured) / measured * 100,
            "kinds": {
                k: {
                    "ops": len(v[2]),
                    "measured_ms": v[0] * 1e3,
                    "predicted_ms": v[1] * 1e3,
                    "sum_error_pct": (v[1] - v[0]) / v[0] * 100 if v[0] else None,
                    "median_op_error_pct": _median(v[2]) * 100 if v[2] else None,
                }
                for k, v in sorted(fams.items(), key=lambda kv: -kv[1][0])
            },
        }
    return out


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


# -- the operator model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibratedOptions:
    calibration: str | None = option(
        None,
        help="a calibration table (JSON, from `python -m "
        "perfmodel.calibrate`), absolute or relative to the "
        "working directory (default: the shipped H100 table)",
    )
    identity: bool = option(
        True, help="on the traced GPU at the traced batch, a real trace's measured times"
    )


@register("calibrated")
class CalibratedModel(CatalogueGPUModel):
    """Operator times from a calibration table for any catalogue GPU: the target GPU, else
    the GPU the trace names. The trace's own times are not used (a shape-only trace has
    none), but on the traced GPU at the traced batch (unsharded) a real trace's operators
    take their measured times (identity; `identity=False` turns it off)."""

    gpu_needed = (
        "a catalogue GPU to time the operators on (perfmodel "
        "'calibrated' predicts GPU times; set `gpu`)"
    )
    Options = CalibratedOptions

    def __init__(self, trace: Trace, calibration=None, identity: bool = True):
        super().__init__(trace)
        self.identity = bool(identity)
        if isinstance(calibration, Calibration):
            self.calibration = calibration
        elif calibration:
            self.calibration = Calibration.load(calibration)
        else:
            self.calibration = shipped()
        self.report = {"calibration": self.calibration.source, "fitted_on": self.calibration.gpu}
        self._fresh()

    def time(self, op, target: Target = Target()) -> float:
        """`predict`, once per target, GPU and class of alike operators (equal
        `features.op_signature`: a shape-only trace's replicated layers; a real trace's
        operators, each with its measured time, seldom share one). An operator is classed
        when first timed: one changed in place afterwards keeps its class (traces are
        not changed once built)."""
        if self.identity:
            same = identity_time(self.trace, op, target)
            if same is not None:
                return same
        gpu = self._gpu(target.gpu)
        hit = self._class_of.get(id(op))
        if hit is None or hit[0] is not op:  # (the operator object itself: kept with it)
            c = self._classes.setdefault(op_signature(self.trace, op), len(self._classes))
            hit = self._class_of[id(op)] = (op, c)
        table = self._times.get(target)
        # (what else predict reads: a GPU redefined, the trace's batch or dtype changed,
        # and the target's times are made again)
        setting = (self.trace.batch_size, self.trace.metadata.get("dtype"))
        if table is None or table[0] is not gpu or table[1] != setting:
            table = self._times[target] = (gpu, setting, {})
        t = table[2].get(hit[1])
        if t is None:
            t = table[2][hit[1]] = predict(self.calibration, self.trace, op, gpu, target)
        return t

    def _fresh(self) -> None:
        self._class_of: dict = {}  # id(operator) -> (the operator, its class)
        self._classes: dict = {}  # signature -> class
        self._times: dict = {}  # target -> (its GPU, trace batch and dtype, {class: seconds})
