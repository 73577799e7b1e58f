"""Linear-regression operator model (the paper's "Li's model" role), with scikit-learn.

Three levels, best first:
1. several traces of the same model at different batch sizes: one line per operator,
   time = a + b * batch, fitted across the traces (operators matched by position);
2. several traces that do not line up: per operator kind, time on FLOPs and bytes moved;
3. one trace: scale the traced time by the work ratio (FLOPs, or bytes where FLOPs are
   unknown) around a fixed per-kernel overhead, fitted on the trace as the kernel-count
   coefficient of time ~ kernels + FLOPs + bytes.
At the traced setting the measured time is returned unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perfmodel.base import (
    OperatorModel,
    Target,
    is_traced_setting,
    op_features,
    register,
    same_gpu,
)
from triosim.common.errors import ConfigError
from triosim.common.schema import option
from triosim.trace.model import Trace


def _check_same_model(trace: Trace, other: Trace, k: int) -> None:
    """An extra trace must be the same model: the same weights and forward layers."""
    layers = lambda t: {o.layer for o in t.operators if o.phase == "forward"}  # noqa: E731
    same = abs(
        other.weight_bytes() - trace.weight_bytes()
    ) <= 1e-9 * trace.weight_bytes() and layers(other) == layers(trace)
    if not same:
        name = other.metadata.get("model") or f"{len(other.operators)} operators"
        raise ConfigError(
            f"perfmodel.extra_traces[{k}]",
            name,
            f"a trace of the same model as the main trace ({trace.weight_bytes():.0f}"
            f" weight bytes; this one has {other.weight_bytes():.0f}, "
            f"{len(layers(other) ^ layers(trace))} layers differ)",
        )


def _design(trace: Trace, ops) -> np.ndarray:
    rows = [(op.kernels, *op_features(trace, op)) for op in ops]
    return np.array(rows, dtype=float).reshape(-1, 3)


def _mape(pred, true) -> float:
    true = np.asarray(true, float)
    mask = true > 0
    if not mask.any():
        return 0.0
    return float(np.mean(np.abs(np.asarray(pred)[mask] - true[mask]) / true[mask]) * 100)


@dataclass(frozen=True)
class RegressionOptions:
    extra_traces: list[str] = option(
        factory=list,
        path=True,
        help="traces of the same model at other batch sizes: per-operator fits",
    )
    holdout: float = option(0.2, ge=0, lt=1, help="share of operators held out to report error")
    seed: int = option(0, ge=0, help="seed of the held-out draw")


@register("regression")
class LinearRegressionModel(OperatorModel):
    Options = RegressionOptions

    @classmethod
    def from_config(cls, trace, options, load_trace):
        extra = [load_trace(p) for p in options.extra_traces]
        return cls(trace, extra, options.holdout, options.seed)

    def __init__(self, trace: Trace, extra_traces=(), holdout: float = 0.2, seed: int = 0):
        super().__init__(trace)
        for k, other in enumerate(extra_traces):
            _check_same_model(trace, other, k)
        self._pos = {o.id: i for i, o in enumerate(trace.operators)}
        self.traces = [trace, *extra_traces]
        self.report: dict = {}
        self.per_op: np.ndarray | None = None  # (n_ops, 2): intercept, slope per batch item
        self.per_kind: dict[
            str, tuple[float, list[float]]
        ] = {}  # name -> intercept, (FLOPs, bytes)
        self._fit_overhead(holdout, seed)
        if len(self.traces) > 1:
            self._fit_per_op()

    # -- fitting --------------------------------------------------------------------------
    def _fit_overhead(self, holdout, seed):
        from sklearn.linear_model import LinearRegression  # lazy: a second to import

        ops = [o for t in self.traces for o in t.operators]
        X = np.vstack([_design(t, t.operators) for t in self.traces])
        y = np.array([o.time for o in ops])
        # scale columns so the positive least squares is well conditioned
        scale = np.where(X.max(axis=0) > 0, X.max(axis=0), 1.0)
        rng = np.random.default_rng(seed)
        test = rng.random(len(y)) < holdout if len(y) >= 10 else np.zeros(len(y), bool)
        reg = LinearRegression(positive=True, fit_intercept=False)
        reg.fit(X[~test] / scale, y[~test])
        if test.any():
            self.report["heldout_mape_pct"] = _mape(reg.predict(X[test] / scale), y[test])
            self.report["heldout_ops"] = int(test.sum())
        reg.fit(X / scale, y)
        coef = reg.coef_ / scale
        # the kernel coefficient absorbs fit error from big ops; the shortest ops are
        # launch overhead and nothing else, so they bound it from above
        # (of the operators that launch kernels: one that launches none, e.g. an item() on
        # a CPU scalar, takes no GPU time and says nothing about a launch)
        launched = X[:, 0] > 0
        floor = float(np.percentile(y[launched] / X[launched, 0], 10)) if launched.any() else 0.0
        self.overhead = min(float(coef[0]), floor)  # seconds per kernel launch
        self.report["overhead_s_per_kernel"] = self.overhead

    def _fit_per_op(self):
        names = [tuple(o.name for o in t.operators) for t in self.traces]
        batches = [t.batch_size for t in self.traces]
        if len(set(names)) != 1 or None in batches or len(set(batches)) < 2:
            self.report["per_op"] = "traces do not line up (different operators or batch sizes)"
            self._fit_per_kind()
            return
        b = np.array(batches, float)
        Y = np.array([[o.time for o in t.operators] for t in self.traces])  # traces x ops
        A = np.vstack([np.ones_like(b), b]).T
        self.per_op = np.linalg.lstsq(A, Y, rcond=None)[0].T  # ops x 2
        if len(b) >= 3:  # leave-one-trace-out error on the iteration time
            errs = []
            for k in range(len(b)):
                keep = np.arange(len(b)) != k
                coef = np.linalg.lstsq(A[keep], Y[keep], rcond=None)[0]
                pred = np.maximum(coef[0] + coef[1] * b[k], 0).sum()
                errs.append(abs(pred - Y[k].sum()) / Y[k].sum() * 100)
            self.report["leave_one_trace_out_pct"] = float(np.mean(errs))

    def _fit_per_kind(self, min_samples: int = 4):
        """Per operator name: time ~ intercept + FLOPs + bytes (non-negative), over every
        operator of that name in every trace; kinds with too few distinct sizes are left to
        the single-trace scaling."""
        from sklearn.linear_model import LinearRegression

        samples: dict[str, list] = {}
        for t in self.traces:
            for op in t.operators:
                samples.setdefault(op.name, []).append((*op_features(t, op), op.time))
        errors = []
        for name, rows in samples.items():
            arr = np.array(rows, float)
            X, y = arr[:, :2], arr[:, 2]
            if len(y) < min_samples or len({tuple(r) for r in X}) < 3:
                continue
            scale = np.where(X.max(axis=0) > 0, X.max(axis=0), 1.0)
            reg = LinearRegression(positive=True).fit(X / scale, y)
            self.per_kind[name] = (float(reg.intercept_), (reg.coef_ / scale).tolist())
            errors.append(_mape(reg.predict(X / scale), y))
        if errors:
            self.report["per_kind_fit_mape_pct"] = float(np.mean(errors))
            self.report["per_kind_kinds"] = len(self.per_kind)

    # -- prediction -----------------------------------------------------------------------
    def time(self, op, target: Target = Target()) -> float:
        if is_traced_setting(self.trace, target):
            return op.time
        traced = self.trace.metadata.get("gpu") or ""
        if target.gpu is not None and not same_gpu(target.gpu, traced):
            raise ConfigError(
                "perfmodel.kind",
                "regression",
                "a target on the traced GPU; use 'learned' or 'roofline' to predict another GPU",
            )
        shard = target.tp if op.tp_split else 1
        if self.per_op is not None:
            index = self._index(op)
            a, slope = self.per_op[index]
            batch = target.batch_size if target.batch_size is not None else self.trace.batch_size
            variable = max(slope * batch, 0.0) / shard
            return max(a, 0.0) + variable if a >= 0 else max(a + variable, 0.0)
        if op.name in self.per_kind:
            intercept, (cf, cb) = self.per_kind[op.name]
            flops, nbytes = op_features(self.trace, op, target)
            return max(intercept + cf * flops + cb * nbytes, 0.0)
        return self._scale(op, target)

    def _scale(self, op, target: Target) -> float:
        f0, b0 = op_features(self.trace, op)
        f1, b1 = op_features(self.trace, op, target)
        ratio = f1 / f0 if f0 > 0 else (b1 / b0 if b0 > 0 else 1.0)
        overhead = min(self.overhead * op.kernels, op.time)
        return overhead + (op.time - overhead) * ratio

    def _index(self, op) -> int:
        return self._pos[op.id]

    # -- persistence ----------------------------------------------------------------------
    def save(self, path) -> Path:
        path = Path(path)
        doc = {
            "kind": "regression",
            "overhead": self.overhead,
            "report": self.report,
            "per_op": None if self.per_op is None else self.per_op.tolist(),
            "per_kind": self.per_kind,
        }
        path.write_text(json.dumps(doc))
        return path

    @classmethod
    def load(cls, path, trace: Trace) -> LinearRegressionModel:
        doc = json.loads(Path(path).read_text())
        if doc.get("kind") != "regression":
            raise ConfigError(
                "perfmodel file", str(path), "a file written by LinearRegressionModel.save"
            )
        self = cls.__new__(cls)
        OperatorModel.__init__(self, trace)
        self._pos = {o.id: i for i, o in enumerate(trace.operators)}
        self.traces = [trace]
        self.overhead = float(doc["overhead"])
        self.report = doc.get("report", {})
        per_op = doc.get("per_op")
        self.per_op = None if per_op is None else np.array(per_op, float)
        self.per_kind = {k: (float(v[0]), list(v[1])) for k, v in doc.get("per_kind", {}).items()}
        if self.per_op is not None and len(self.per_op) != len(trace.operators):
            raise ConfigError(
                "perfmodel file", str(path), "a model fitted on this trace's operators"
            )
        return self
