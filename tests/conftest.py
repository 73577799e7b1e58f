"""Shared helpers: synthetic traces whose answers are known in closed form."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from triosim.trace.model import Operator, Tensor, Trace

ROOT = Path(__file__).resolve().parents[1]  # the repository root, wherever the clone sits


def shared_reference_dirs() -> list[Path]:
    """Where shared/reference may be, in order: inside the repository, beside it, and
    $TRIOSIM_SHARED (the `shared` folder itself)."""
    dirs = [ROOT / "shared" / "reference", ROOT.parent / "shared" / "reference"]
    if os.environ.get("TRIOSIM_SHARED"):
        dirs.append(Path(os.environ["TRIOSIM_SHARED"]) / "reference")
    return dirs


def shared_reference(name: str) -> Path:
    """shared/reference/<name> from the first place that has it; skips the test otherwise."""
    for d in shared_reference_dirs():
        if (d / name).is_dir():
            return d / name
    pytest.skip(
        f"shared/reference/{name} not found in "
        + ", ".join(map(str, shared_reference_dirs()))
        + " (set TRIOSIM_SHARED to the folder holding reference/)"
    )


def _first_go_traces() -> Path:
    for d in shared_reference_dirs():
        if (d / "triosim-go-traces").is_dir():
            return d / "triosim-go-traces"
    return shared_reference_dirs()[1] / "triosim-go-traces"


GO_TRACES = _first_go_traces()  # for skipif markers: the first place that has them


def chain_trace(
    layers=4,
    t_fwd=1e-3,
    t_bwd=2e-3,
    t_opt=0.5e-3,
    weight_bytes=4e6,
    act_bytes=1e6,
    batch=8,
    flops_per_s=1e12,
    split=True,
) -> Trace:
    """A chain of `layers` linear layers: forward op i reads activation i and weight i and
    writes activation i+1; backward op i (fwd_id = forward i) writes weight i's gradient.
    FLOPs are time x flops_per_s, so FLOP-ratio scaling is exact."""
    tensors, ops = {}, []

    def add(cat, nbytes, shape):
        t = Tensor(len(tensors), shape, "float32", float(nbytes), cat)
        tensors[t.id] = t
        return t.id

    acts = [add("input", act_bytes, (batch, 8))]
    weights = []
    for i in range(layers):
        w = add("weight", weight_bytes, (64, 16))
        weights.append(w)
        a = add("activation", act_bytes, (batch, 8))
        ops.append(
            Operator(
                len(ops),
                "aten::linear",
                f"layer{i}",
                "forward",
                t_fwd,
                (acts[-1], w),
                (a,),
                t_fwd * flops_per_s,
                tp_split=split,
            )
        )
        acts.append(a)
    grads = {}
    for i in reversed(range(layers)):
        g = add("gradient", weight_bytes, (64, 16))
        ga = add("activation", act_bytes, (batch, 8))
        grads[i] = g
        ops.append(
            Operator(
                len(ops),
                "AddmmBackward0",
                f"layer{i}",
                "backward",
                t_bwd,
                (acts[i + 1], weights[i]),
                (ga, g),
                t_bwd * flops_per_s,
                fwd_id=i,
                tp_split=split,
            )
        )
    if t_opt:
        ops.append(
            Operator(
                len(ops),
                "aten::_foreach_add_",
                "optimizer",
                "optimizer",
                t_opt,
                tuple(weights) + tuple(grads.values()),
                (),
                None,
            )
        )
    return Trace(ops, tensors, {"batch_size": batch, "gpu": "H100-SXM"}).validate()


def run_cli(capsys, *args):
    """Run the command line in this process: (exit code, stdout, stderr). An exception
    escaping main() fails the test (it would be a traceback for the user)."""
    from triosim.cli.main import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse: --help, --version, usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def chain():
    return chain_trace()


def pytest_terminal_summary(terminalreporter):
    import sys

    mod = next((m for n, m in sys.modules.items() if n.split(".")[-1] == "test_fuzz"), None)
    TRIED = getattr(mod, "TRIED", None)
    if TRIED:
        terminalreporter.write_line(
            "fuzz inputs tried: " + ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items()))
        )


# CI runs the same examples every time (derandomize): a red CI then means a change broke
# something, not that the fuzzer got lucky. Locally the search stays random.
from hypothesis import settings as _settings  # noqa: E402

_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    _settings.load_profile("ci")


@pytest.fixture
def scratch_registries():
    """Parts a test registers (a user's network, mode, model) are gone after it, so that
    no other test sees them (the schema's field lists and messages read the registries)."""
    from extrapolators.communication import COMM_MODELS
    from extrapolators.modes import EXTRAPOLATORS
    from networks import NETWORKS
    from networks.topology import TOPOLOGIES
    from perfmodel import MODELS

    registries = (COMM_MODELS, EXTRAPOLATORS, NETWORKS, TOPOLOGIES, MODELS)
    saved = [dict(r._parts) for r in registries]
    yield
    for r, parts in zip(registries, saved, strict=True):
        r._parts.clear()
        r._parts.update(parts)


class TraceBuilder:
    """A hand-built float32 trace (the attention tests' builders): `tensor(shape,
    category)` and `op(...)` add one each and give its id, in order; an operator's FLOPs
    are its time x 1e12, so the performance model scales it exactly by its share."""

    def __init__(self):
        self.tensors: dict = {}
        self.ops: list = []

    def tensor(self, shape, cat) -> int:
        t = Tensor(len(self.tensors), tuple(shape), "float32", float(math.prod(shape) * 4), cat)
        self.tensors[t.id] = t
        return t.id

    def op(self, name, layer, phase, time, ins, outs, fwd=None, split=False) -> int:
        self.ops.append(
            Operator(len(self.ops), name, layer, phase, time, tuple(ins), tuple(outs),
                     time * 1e12, fwd_id=fwd, tp_split=split)
        )  # fmt: skip
        return self.ops[-1].id
