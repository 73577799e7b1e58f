"""An operator-time model learned from real GPU traces, whose efficiency follows the
operator's shape.

Each operator that launches a kernel has a roof on a GPU, R = max(FLOPs / the peak of the
units that run it, bytes / memory bandwidth) (perfmodel.features), and a kind's fixed
overhead o (the median time of that kind's operators that do next to nothing: launch and
tail; the table's floor where a kind has none). Its time is

    time = (o + R) x exp(f(shape))

where f, learned on the measured operators of real traces of one GPU, maps the operator's
shape (log10 FLOPs, log10 bytes, their ratio: the arithmetic intensity, its family, for a
convolution with its kernel and stem input: perfmodel.kinds.conv_variant, and math
mode) to how far above (o + R) it runs: one number per kind cannot follow a convolution's
or a matrix product's efficiency over its sizes. Forms of f (`FORMS`; the benchmark
`benchmarks/modelled_vs_real.py` prints each one's held-out error, leaving one model out):

- "const": one value per kind (name, else family, class, all): the roofline with a fitted
  efficiency per kind, the older `calibrated` model's form;
- "curve": per kind, a line in log FLOPs and log bytes (ridge), inputs clipped to half a
  decade beyond what the kind was fitted on;
- "boost": scikit-learn's HistGradientBoostingRegressor over all kinds (family and math mode
  categorical), constrained to not rise with FLOPs or bytes (a larger operator never runs
  less efficiently: it extrapolates to larger shapes flat instead of at random).

Samples are weighted by the square root of their time (large operators decide the
iteration, many small ones still count); operators with identical features are merged.

Another GPU: R takes that GPU's peaks and bandwidth; f and o are kept (they depend on the
shape only): the assumption that the fraction of its roof an operator of a given shape
reaches does not change between GPUs. The table (perfmodel/calibration/h100-learned.json)
holds the merged samples, not a fitted estimator, and is fitted when loaded (deterministic);
`python -m perfmodel.refit` rebuilds it from every real trace under traces/<gpu>/.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from perfmodel.base import CatalogueGPUModel, Target, identity_time, register
from perfmodel.features import op_bytes, op_flops, roofs
from perfmodel.kinds import (
    COMPUTE_FAMILIES,
    base_family,
    conv_variant,
    launches_no_kernel,
    op_kind,
)
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.hardware import catalogue as hardware
from triosim.trace.model import Operator, Trace

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"
SHIPPED = CALIBRATION_DIR / "h100-learned.json"
FORMS = ("const", "curve", "boost")
DEFAULT_FORM = "boost"  # the least held-out error (benchmarks/modelled_vs_real.py)
FORMAT = "triosim-learned-table"


def shape_features(trace: Trace, op: Operator, target: Target = Target()) -> tuple:
    """(family, math, log10 FLOPs, log10 bytes) of an operator at the target; a
    convolution's family carries its kernel and stem input (perfmodel.kinds.conv_variant)."""
    family, _ = op_kind(op)
    family = conv_variant(trace, op, family)
    math_mode = op.math or trace.metadata.get("dtype") or "float32"
    lf = math.log10(op_flops(trace, op, target) + 1.0)
    lb = math.log10(op_bytes(trace, op, target) + 1.0)
    return family, math_mode, lf, lb


def _cls(family: str) -> str:
    return "compute" if base_family(family) in COMPUTE_FAMILIES else "memory"


@dataclass
class Samples:
    """Merged samples: per distinct (family, math, log FLOPs, log bytes) the mean of
    y = log(time / (overhead + roof)) and the summed weight (sqrt of the times)."""

    family: list[str]
    math: list[str]
    lf: np.ndarray
    lb: np.ndarray
    y: np.ndarray
    w: np.ndarray

    def rows(self) -> list:
        return [
            [f, m, round(float(a), 6), round(float(b), 6), round(float(y), 6), float(w)]
            for f, m, a, b, y, w in zip(
                self.family, self.math, self.lf, self.lb, self.y, self.w, strict=True
            )
        ]

    @classmethod
    def from_rows(cls, rows) -> Samples:
        cols = list(zip(*rows, strict=True)) if rows else [[]] * 6
        return cls(
            list(cols[0]),
            list(cols[1]),
            *(np.asarray(c, dtype=float) for c in cols[2:]),
        )


def _timed_kernels(traces: list[Trace]):
    """(trace, operator, family) of every operator with a measured time that launches a
    kernel, in trace order: what the overheads and the samples are taken from."""
    for t in traces:
        for op in t.operators:
            family, _ = op_kind(op)
            if not (op.time <= 0 or launches_no_kernel(t, op, family)):
                yield t, op, family


def overheads(traces: list[Trace], gpu: hardware.GPU) -> tuple[dict[str, float], float]:
    """Per family, the median time of its operators whose roof is under 1 % of their time
    (a kernel that does next to nothing: launch and tail); and the same over all kinds."""
    tiny: dict[str, list] = {}
    for t, op, family in _timed_kernels(traces):
        if max(roofs(t, op, gpu)) < 0.01 * op.time:
            tiny.setdefault(family, []).append(op.time)
    floor = float(np.median([x for v in tiny.values() for x in v])) if tiny else 1e-6
    per = {k: float(np.median(v)) for k, v in tiny.items() if len(v) >= 5}
    return per, floor


def collect(traces: list[Trace], gpu: str) -> tuple[Samples, dict[str, float], float]:
    """The merged samples of real traces of `gpu` (measured times), with the overheads."""
    g = hardware.gpu(gpu)
    per, floor = overheads(traces, g)
    acc: dict[tuple, list] = {}
    for t, op, family in _timed_kernels(traces):
        f = shape_features(t, op)
        key = (f[0], f[1], round(f[2], 6), round(f[3], 6))
        o = per.get(family, floor)
        y = math.log(op.time / (o + max(roofs(t, op, g))))
        a = acc.setdefault(key, [0.0, 0.0])
        w = math.sqrt(op.time)
        a[0] += w * y
        a[1] += w
    if not acc:
        raise ConfigError("traces", len(traces), "real traces with timed operators")
    keys = sorted(acc)
    return (
        Samples(
            [k[0] for k in keys],
            [k[1] for k in keys],
            np.array([k[2] for k in keys]),
            np.array([k[3] for k in keys]),
            np.array([acc[k][0] / acc[k][1] for k in keys]),
            np.array([acc[k][1] for k in keys]),
        ),
        per,
        floor,
    )


# -- the forms of f ----------------------------------------------------------------------------


class _Const:
    """One weighted mean of y per family, class and all (the most specific one known)."""

    def __init__(self, s: Samples):
        self.mean: dict[str, float] = {}
        groups: dict[str, list] = {}
        for i, fam in enumerate(s.family):
            for k in dict.fromkeys((fam, base_family(fam), _cls(fam), "all")):
                groups.setdefault(k, []).append(i)
        for k, idx in groups.items():
            self.mean[k] = float(np.average(s.y[idx], weights=s.w[idx]))

    def __call__(self, family, math_mode, lf, lb) -> np.ndarray:
        return np.array([self._get(f) for f in family])

    def _get(self, fam):
        for k in (fam, base_family(fam), _cls(fam)):
            if k in self.mean:
                return self.mean[k]
        return self.mean["all"]


class _Curve(_Const):
    """Per family, a ridge line in (log FLOPs, log bytes), inputs clipped to half a decade
    beyond the family's range; a family of few samples or one size keeps its mean."""

    def __init__(self, s: Samples):
        from sklearn.linear_model import Ridge

        super().__init__(s)
        self.lines: dict[str, tuple] = {}
        fams = np.array(s.family)
        x = np.c_[s.lf, s.lb]
        for fam in set(s.family):
            i = fams == fam
            if i.sum() < 8 or np.ptp(x[i].sum(axis=1)) < 0.5:
                continue
            r = Ridge(alpha=1.0).fit(x[i], s.y[i], sample_weight=s.w[i])
            self.lines[fam] = (r.intercept_, r.coef_, x[i].min(0) - 0.5, x[i].max(0) + 0.5)

    def __call__(self, family, math_mode, lf, lb) -> np.ndarray:
        out = super().__call__(family, math_mode, lf, lb)
        for j, fam in enumerate(family):
            if fam in self.lines:
                b0, b, lo, hi = self.lines[fam]
                out[j] = b0 + np.clip([lf[j], lb[j]], lo, hi) @ b
        return out


class _Boost:
    """Gradient-boosted trees over all kinds; y never rises with FLOPs or bytes."""

    def __init__(self, s: Samples):
        from sklearn.ensemble import HistGradientBoostingRegressor

        self.fams = {f: i for i, f in enumerate(sorted(set(s.family)))}
        self.maths = {m: i for i, m in enumerate(sorted(set(s.math)))}
        self.model = HistGradientBoostingRegressor(
            max_iter=300,
            learning_rate=0.05,
            min_samples_leaf=10,
            categorical_features=[3, 4],
            monotonic_cst=[-1, -1, 0, 0, 0],
            early_stopping=False,
            random_state=0,
        ).fit(self._x(s.family, s.math, s.lf, s.lb), s.y, sample_weight=s.w)

    def _x(self, family, math_mode, lf, lb) -> np.ndarray:
        lf, lb = np.asarray(lf, float), np.asarray(lb, float)
        fam = [self.fams.get(f, np.nan) for f in family]
        mm = [self.maths.get(m, np.nan) for m in math_mode]
        return np.c_[lf, lb, lf - lb, fam, mm]

    def __call__(self, family, math_mode, lf, lb) -> np.ndarray:
        return self.model.predict(self._x(family, math_mode, lf, lb))


_FORM_CLASSES = {"const": _Const, "curve": _Curve, "boost": _Boost}


# -- the table ---------------------------------------------------------------------------------


@dataclass
class LearnedTable:
    """Merged samples of one GPU's real traces, the per-family overheads, and the form;
    `f` (fitted on first use) maps shape features to y."""

    gpu: str
    samples: Samples
    overhead: dict[str, float]
    floor: float
    form: str = DEFAULT_FORM
    source: str = ""
    heldout: dict = field(default_factory=dict)
    _f: object = field(default=None, repr=False)

    @property
    def f(self):
        if self._f is None:
            if self.form not in FORMS:
                raise ConfigError("perfmodel.form", self.form, f"one of {FORMS}")
            self._f = _FORM_CLASSES[self.form](self.samples)
        return self._f

    def times(self, trace: Trace, ops: list[Operator], gpu: hardware.GPU, target=Target()):
        """Modelled seconds of `ops` on `gpu` at the target (0 for operators with no kernel)."""
        feats, base, idx = [], [], []
        out = np.zeros(len(ops))
        for j, op in enumerate(ops):
            family, _ = op_kind(op)
            if launches_no_kernel(trace, op, family):
                continue
            feats.append(shape_features(trace, op, target))
            base.append(self.overhead.get(family, self.floor) + max(roofs(trace, op, gpu, target)))
            idx.append(j)
        if idx:
            cols = list(zip(*feats, strict=True))
            out[idx] = np.asarray(base) * np.exp(self.f(*cols))
        return out

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "gpu": self.gpu,
            "form": self.form,
            "source": self.source,
            "floor": self.floor,
            "overhead": self.overhead,
            "columns": ["family", "math", "log10_flops", "log10_bytes", "y", "weight"],
            "samples": self.samples.rows(),
            "heldout": self.heldout,
        }

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), separators=(",", ":")) + "\n")
        return path

    @classmethod
    def load(cls, path, form: str | None = None) -> LearnedTable:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                "perfmodel.table", str(path), f"a readable table (JSON): {e}"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError("perfmodel.table", str(path), f'a table ("format": "{FORMAT}")')
        if not isinstance(doc.get("samples"), list) or not doc["samples"]:
            raise ConfigError("perfmodel.table", str(path), "a table with samples")
        form = form or doc.get("form", DEFAULT_FORM)
        if form not in FORMS:
            raise ConfigError("perfmodel.form", form, f"one of {FORMS}")
        return cls(
            hardware.gpu(doc["gpu"]).name,
            Samples.from_rows(doc["samples"]),
            {k: float(v) for k, v in doc.get("overhead", {}).items()},
            float(doc["floor"]),
            form,
            doc.get("source", str(path)),
            doc.get("heldout", {}),
        )


def fit(traces: list[Trace], gpu: str, form: str = DEFAULT_FORM, source: str = "") -> LearnedTable:
    """A table from real traces taken on `gpu` (their measured operator times)."""
    if form not in FORMS:
        raise ConfigError("perfmodel.form", form, f"one of {FORMS}")
    s, per, floor = collect(traces, gpu)
    return LearnedTable(hardware.gpu(gpu).name, s, per, floor, form, source)


@lru_cache(maxsize=8)
def _load(path: str, form: str | None) -> LearnedTable:
    return LearnedTable.load(path, form)


def shipped(form: str | None = None) -> LearnedTable:
    """The shipped table (fitted on the H100 traces under traces/h100/)."""
    if not SHIPPED.exists():
        raise ConfigError(
            "perfmodel.table", str(SHIPPED), "the shipped table (python -m perfmodel.refit)"
        )
    return _load(str(SHIPPED), form)


# -- the operator model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnedOptions:
    table: str | None = option(
        None,
        help="a table from `python -m perfmodel.refit` (default: the shipped H100 one)",
    )
    form: str | None = option(None, help=f"one of {FORMS} (default: the table's)")
    identity: bool = option(
        True, help="on the traced GPU at the traced batch, a real trace's measured times"
    )


@register("learned")
class LearnedModel(CatalogueGPUModel):
    """Operator times from a learned table for any catalogue GPU (the target's, else the
    trace's). A real trace on its own GPU at its own batch, unsharded, keeps its measured
    times (identity); elsewhere, and for a shape-only trace, the table's."""

    gpu_needed = "a catalogue GPU to time the operators on (perfmodel 'learned')"
    Options = LearnedOptions

    def __init__(self, trace: Trace, table=None, form=None, identity: bool = True):
        super().__init__(trace)
        if isinstance(table, LearnedTable):
            self.table = table
        else:
            self.table = _load(str(table), form) if table else shipped(form)
        self.identity = bool(identity)
        self._cache: dict = {}
        self.report = {"table": self.table.source, "fitted_on": self.table.gpu}

    def _fresh(self) -> None:
        self._cache = {}  # a view's times are its own (OperatorModel.view)

    def time(self, op, target: Target = Target()) -> float:
        if self.identity:
            same = identity_time(self.trace, op, target)
            if same is not None:
                return same
        key = (target, self.trace.metadata.get("gpu"))
        if key not in self._cache:  # one vectorised pass over the trace per target
            ops = self.trace.operators
            times = self.table.times(self.trace, ops, self._gpu(target.gpu), target)
            self._cache[key] = {id(o): float(x) for o, x in zip(ops, times, strict=True)}
        got = self._cache[key].get(id(op))
        if got is None:  # an operator not in the trace (a TP shard's copy)
            got = float(self.table.times(self.trace, [op], self._gpu(target.gpu), target)[0])
        return got
