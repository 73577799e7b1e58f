"""Shared helpers: synthetic traces whose answers are known in closed form."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# Under pytest-xdist (-n auto: one worker per core) a native thread pool of a worker can only
# oversubscribe the cores: OpenMP (scikit-learn's gradient boosting in perfmodel.learned),
# OpenBLAS and torch's intra-op threads spin at their barriers while the other worker holds
# the core, and on CI's 2 cores that made test_learned_model several times slower (81 s to
# 343 s for one test between two runs of the suite). One thread per worker; set before
# numpy, scikit-learn or torch load (they read these once), and inherited by the
# subprocesses a test starts. A value already set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest  # noqa: E402

from triosim.trace.model import Operator, Tensor, Trace  # noqa: E402

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
def no_group_jobs(monkeypatch):
    """Every transfer through the packet engine's flow table (tests of its solver: a group
    alone on its links would otherwise run as a job, networks.packet.groupjobs)."""
    from networks.packet.groupjobs import GroupJobs

    monkeypatch.setattr(GroupJobs, "enabled", False)


@pytest.fixture
def chain():
    return chain_trace()


def pytest_terminal_summary(terminalreporter):
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


# -- coverage on the long tests ----------------------------------------------------------------
# A test marked `@pytest.mark.no_cover` (pytest-cov's marker) runs its body without line
# tracing: the long fuzzers, the large traces and the end-to-end runs repeat lines that the
# rest of the suite covers, and under --cov they ran 1.7-3x slower than without. What such a
# test asserts is unchanged; only which lines --cov records from it. The ones marked were
# chosen from a run with per-test contexts (--cov-context=test): every line one of them
# executes is also executed by a test that is traced (with the marks, the suite covers every
# line it covered without them). A test that is slow under --cov and executes lines no
# other test does stays traced; a new marked test must keep to the same rule.

# Single cases of parametrized tests that run untraced, as the marked tests do: the other
# cases of these tests execute lines that no other test does, so they stay traced.
NO_COVER_CASES = frozenset(
    {
        "tests/test_memory_gpu_traces.py::test_shape_only_twin_peak_within_5_percent[h100/traces/gpt2-s512-b8]",
        "tests/test_docs_examples.py::test_page_examples[docs/models.md]",
        "tests/test_cli.py::test_every_large_example_is_a_valid_plan[megatron_deepseek_v3.yaml]",
        "tests/test_cli.py::test_every_large_example_is_a_valid_plan[titan_llama405b_3d.yaml]",
        "tests/test_route_speedups.py::test_nccl_plans_are_those_of_the_per_hop_code[fat tree]",
        "tests/test_moe_models.py::test_real_and_shape_only_traces_agree_and_layers_replicate[mixtral-8x7b]",
        "tests/test_cli.py::test_every_example_runs[hop.yaml]",
        "tests/test_cli.py::test_every_example_runs[densenet_ddp_host.yaml]",
        "tests/test_cli.py::test_every_example_runs[photonic_wafer.yaml]",
        "tests/test_cli.py::test_every_large_example_is_a_valid_plan[titan_llama405b_4d.yaml]",
        "tests/test_route_speedups.py::test_nccl_plans_are_those_of_the_per_hop_code[slow fat tree]",
        "tests/test_cli.py::test_every_large_example_is_a_valid_plan[titan_llama70b_fsdp_tp.yaml]",
        "tests/test_cli.py::test_every_example_runs[ddp_h100_node.yaml]",
        "tests/test_cli.py::test_every_example_runs[1f1b.yaml]",
        "tests/test_cli.py::test_every_large_example_is_a_valid_plan[mixtral_ep.yaml]",
        "tests/test_llama.py::test_parameter_count_matches_the_published_one[llama3.1-405b]",
    }
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in NO_COVER_CASES:
            item.add_marker(pytest.mark.no_cover)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item):
    """pytest-cov pauses its coverage around a marked test's call, but in an xdist worker
    a second Coverage object sits under pytest-cov's (two on coverage's stack: pausing the
    top one resumes the other, and the marked test ran traced, as slow as before). Inside
    pytest-cov's pause (trylast: the innermost wrapper), this thread runs untraced; the
    tracer there before is put back after the call."""
    if item.get_closest_marker("no_cover") is None:
        yield
        return
    before = sys.gettrace()
    sys.settrace(None)
    try:
        yield
    finally:
        sys.settrace(before)


@pytest.fixture(scope="session", autouse=True)
def _measured_modules_imported():
    """A module's top-level lines run once per process, on its first import, and a marked
    test could be that first import: so every module of the measured packages is imported
    here, traced, before the first test."""
    import importlib
    import pkgutil

    for name in ("triosim", "tracer", "extrapolators", "networks", "perfmodel"):
        pkg = importlib.import_module(name)
        for m in pkgutil.walk_packages(pkg.__path__, name + "."):
            importlib.import_module(m.name)
