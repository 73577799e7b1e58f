from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from tracer import collect  # noqa: E402
from triosim.common.errors import TracerError  # noqa: E402


def tiny(batch=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def make_batch(b, device):
        return torch.randn(b, 8, device=device), torch.randint(0, 4, (b,), device=device)

    opt = torch.optim.Adam(model.parameters())
    return collect(
        model,
        make_batch,
        torch.nn.functional.cross_entropy,
        opt,
        batch_size=batch,
        warmup=1,
        measure=2,
        model_name="tiny",
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # these models are tiny: a second intra-op thread only spins, and on a busy 2-core
    # machine spinning threads make tracing several times slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trace():
    return tiny()


def test_every_tensor_is_defined_and_trace_validates(trace):
    used = {t for op in trace.operators for t in op.inputs + op.outputs}
    assert used <= set(trace.tensors)
    trace.validate()
    assert (
        trace.metadata["batch_size"] == 4
        and trace.metadata["parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    )
    assert trace.metadata["measured_iteration_time"] > 0


def test_forward_and_backward_are_paired(trace):
    fwd = {op.id: op for op in trace.operators if op.phase == "forward"}
    bwd = [op for op in trace.operators if op.phase == "backward" and op.fwd_id is not None]
    linear_bwd = [op for op in bwd if "AddmmBackward" in op.name]
    assert len(linear_bwd) == 2
    for op in bwd:
        assert op.fwd_id in fwd and fwd[op.fwd_id].layer == op.layer
    assert {fwd[op.fwd_id].layer for op in linear_bwd} == {"0", "2"}


def test_weights_and_gradients_have_matching_shapes(trace):
    cats = Counter(t.category for t in trace.tensors.values())
    assert cats["weight"] == 4 and cats["gradient"] == 4
    w = Counter(t.shape for t in trace.tensors.values() if t.category == "weight")
    g = Counter(t.shape for t in trace.tensors.values() if t.category == "gradient")
    assert w == g


def test_linear_flops_are_2mnk(trace):
    lin = [op for op in trace.operators if op.phase == "forward" and op.name == "aten::linear"]
    assert [op.flops for op in lin] == [2 * 4 * 8 * 16, 2 * 4 * 16 * 4]
    assert all(op.tp_split for op in lin)


def test_phases_in_order(trace):
    phases = [op.phase for op in trace.operators]
    assert phases.index("backward") > phases.index("forward")
    assert phases[-1] == "optimizer" and "forward" not in phases[phases.index("backward") :]


def test_model_that_raises():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            raise RuntimeError("boom")

    m = Broken()
    with pytest.raises(TracerError, match="raised while tracing: RuntimeError: boom"):
        collect(
            m,
            lambda b, d: (torch.zeros(b, 2), torch.zeros(b)),
            torch.nn.functional.mse_loss,
            torch.optim.SGD(m.parameters(), 0.1),
            batch_size=2,
            warmup=1,
            measure=1,
        )


def test_empty_model_and_non_module():
    empty = torch.nn.Sequential()
    with pytest.raises(TracerError, match="no trainable parameters"):
        collect(empty, None, None, None, batch_size=2)
    with pytest.raises(TracerError, match="must be a torch.nn.Module"):
        collect(lambda x: x, None, None, None, batch_size=2)


def test_unsupported_schema_is_named():
    from tracer.linking import link

    with pytest.raises(TracerError, match="schema '9.9'"):
        link({"schema": "9.9", "nodes": []}, {}, gpu=False, metadata={})


def test_cli_traces_a_custom_model(tmp_path, monkeypatch, capsys):
    # `triosim trace module:function` in this process: the module is found on sys.path
    from triosim.cli.main import main
    from triosim.trace.model import load

    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))\n"
        "    return m, lambda b, d: (torch.randn(b, 4), torch.randint(0, 2, (b,))), "
        "torch.nn.functional.cross_entropy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    assert (
        main(
            [
                "trace",
                "mymodel:build",
                "--batch-size",
                "3",
                "--out",
                str(out),
                "--warmup",
                "1",
                "--measure",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"wrote {out / 'build-b3.trace.json.gz'}" in printed
    t = load(out / "build-b3.trace.json.gz")
    assert t.batch_size == 3 and sum(o.name == "aten::linear" for o in t.operators) == 2
    # the measured peak: at least the step's start, which holds the weights and Adam's two
    # states (3 x 58 float32 parameters) and the batch
    m = t.metadata
    assert m["peak_memory_bytes"] >= m["memory_at_step_start_bytes"] >= 3 * 58 * 4
    assert f"measured peak memory     {m['peak_memory_bytes'] / 1e6:.3f} MB" in printed
    assert main(["trace", "nosuch", "--batch-size", "2", "--out", str(tmp_path)]) == 2
    assert "unknown model 'nosuch'" in capsys.readouterr().err


# published parameter counts (millions): torchvision's model cards; GPT-2 small 124M;
# BERT-base 110M includes token-type embeddings and the pooler, which this encoder omits
PUBLISHED = {
    "resnet18": 11.69,
    "resnet50": 25.56,
    "resnet152": 60.19,
    "vgg11": 132.86,
    "vgg16": 138.36,
    "densenet121": 7.98,
    "gpt2": 124.44,
    "bert": 108.9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_reference_models_match_published_sizes(name):
    from tracer.models import build

    with torch.device("meta"):  # shapes only: no memory or init time for 138M weights
        model, _, _ = build(name)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(
        PUBLISHED[name], rel=0.005
    )


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "vgg11", "bert"])
def test_small_reference_models_trace_and_replay(name):
    from tracer.cli import trace_model
    from triosim.simulation.wiring import Simulation

    t = trace_model(name, 2, small=True, image_size=32, seq_len=16, warmup=1, measure=1)
    assert {o.phase for o in t.operators} == {"forward", "backward", "optimizer"}
    assert any(o.flops for o in t.operators) and any(o.fwd_id is not None for o in t.operators)
    r = Simulation({"num_gpus": 2, "parallelism": {"mode": "ddp"}}, trace=t).run()
    assert r.iteration_time > 0


def test_gpu_time_is_the_union_of_linked_kernels():
    # no GPU here: record a CPU iteration, then add kernel events the way Kineto writes them
    # on a GPU (cat "kernel", args "External id" = the launching cpu_op's) and link as GPU
    from tracer.collect import record
    from tracer.linking import link

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    et, kineto, meta = record(
        model,
        lambda b, d: (torch.randn(b, 8), torch.randint(0, 4, (b,))),
        torch.nn.functional.cross_entropy,
        torch.optim.Adam(model.parameters()),
        batch_size=4,
        warmup=1,
        measure=1,
    )
    ops = {
        e["args"]["Record function id"]: e
        for e in kineto["traceEvents"]
        if e.get("cat") == "cpu_op" and "Record function id" in e.get("args", {})
    }
    rf = {a["value"]: n for n in et["nodes"] for a in n.get("attrs", []) if a["name"] == "rf_id"}
    addmm = [n for n in et["nodes"] if n["name"] == "aten::addmm"]
    first = next(ops[a["value"]] for a in addmm[0]["attrs"] if a["name"] == "rf_id")
    ext = first["args"]["External id"]
    # two overlapping kernels (union 15 us) and one apart (5 us): 20 us in all
    for ts, dur in ((100.0, 10.0), (105.0, 10.0), (200.0, 5.0)):
        kineto["traceEvents"].append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": "gemm",
                "ts": ts,
                "dur": dur,
                "args": {"External id": ext, "correlation": 1},
            }
        )
    t = link(et, kineto, gpu=True, metadata=meta)
    lin = [op for op in t.operators if op.name == "aten::linear"]
    assert lin[0].time == pytest.approx(20e-6) and lin[0].kernels == 3
    assert lin[1].time == 0.0 and lin[1].kernels == 0  # no kernels linked to it: 0, not 1
    assert rf  # the ET carried record-function ids to link by


def test_a_lifted_constant_at_a_reused_pointer_is_new_memory():
    """ET storage ids are data pointers, reused once memory is freed. A tensor first seen as
    an input at a pointer seen before is a handle on memory still alive (a saved tensor
    unpacked for backward) and joins it; the input of aten::lift_fresh is a constant just
    made from Python data (an optimizer's scalar) and must not: it took the freed tensor's
    category in some runs and not in others."""
    from tracer.linking import alias_storage

    def side(ts):
        return {
            "values": [list(x) for x in ts],
            "types": ["Tensor(float)"] * len(ts),
            "shapes": [[]] * len(ts),
        }

    def node(i, name, schema, ins=(), outs=()):
        return {
            "id": i,
            "name": name,
            "inputs": side(ins),
            "outputs": side(outs),
            "attrs": [{"name": "op_schema", "value": schema}],
        }

    t = {k: [k, 500, 0, 1, 4, "cpu"] for k in (1, 2, 3, 4)}  # four tensors, one pointer
    nodes = [
        node(10, "aten::empty", "aten::empty(int[] size) -> Tensor", outs=[t[1]]),
        node(11, "aten::neg", "aten::neg(Tensor self) -> Tensor", ins=[t[2]]),
        node(
            12,
            "aten::lift_fresh",
            "aten::lift_fresh(Tensor(a) self) -> Tensor(a)",
            ins=[t[3]],
            outs=[t[4]],
        ),
    ]
    assert alias_storage(nodes)
    storage = {n["inputs"]["values"][0][0]: n["inputs"]["values"][0][1] for n in nodes[1:]}
    storage[1], storage[4] = (
        nodes[0]["outputs"]["values"][0][1],
        nodes[2]["outputs"]["values"][0][1],
    )
    assert storage[2] == storage[1]  # a saved tensor's new handle: the same memory
    assert storage[3] != storage[1] and storage[4] == storage[3]  # lifted: its own


def test_timed_iterations_run_without_the_tracers_hooks_or_markers(monkeypatch):
    """measured_iteration_time comes from iterations with no module hook, no marker range
    and no profiler of the tracer's: a fake clock advances 1 s per forward that runs under
    any of them and 1 ms per plain forward, so the plain timed mean is exactly 1 ms and the
    hooked iterations' (measured_iteration_time_hooked) 1 s."""
    import contextlib
    import importlib
    import types

    tc = importlib.import_module("tracer.collect")
    clock = [0.0]
    depth = [0]
    real_record = tc._record

    @contextlib.contextmanager
    def counted(name):
        depth[0] += 1
        try:
            with real_record(name):
                yield
        finally:
            depth[0] -= 1

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            hooked = (
                depth[0] > 0
                or any(m._forward_pre_hooks or m._forward_hooks for m in self.modules())
                or torch.autograd.profiler._is_profiler_enabled
            )
            clock[0] += 1.0 if hooked else 1e-3
            return self.lin(x)

    monkeypatch.setattr(tc, "_record", counted)
    monkeypatch.setattr(tc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    torch.manual_seed(0)
    model = Spy()
    t = collect(
        model,
        lambda b, device: (torch.randn(b, 8), torch.randint(0, 4, (b,))),
        torch.nn.functional.cross_entropy,
        torch.optim.Adam(model.parameters()),
        batch_size=2,
        warmup=1,
        measure=3,
        model_name="spy",
    )
    assert t.metadata["measured_iteration_time"] == pytest.approx(1e-3)
    assert t.metadata["measured_iteration_time_hooked"] == pytest.approx(1.0)
    assert t.metadata["measured_iterations"] == 3
    # the profiled iteration still ran under the markers: its forward is in the trace
    assert any(op.phase == "forward" for op in t.operators)


def test_a_cast_is_new_memory_though_its_schema_says_it_may_alias():
    """`aten::to(Tensor(a) self, ...) -> Tensor(a)` returns its input when no conversion is
    needed (the same memory) and a copy otherwise: a bfloat16 activation cast to float32
    (element size 2 -> 4) gets a storage of its own; a cast to its own dtype shares it."""
    from tracer.linking import alias_storage

    schema = "aten::to.dtype(Tensor(a) self, ScalarType dtype) -> Tensor(a)"

    def side(ts):
        types = [f"Tensor({'float' if x[4] == 4 else 'c10::BFloat16'})" for x in ts]
        return {"values": [list(x) for x in ts], "types": types, "shapes": [[8]] * len(ts)}

    def node(i, ins, outs):
        return {
            "id": i,
            "name": "aten::to",
            "inputs": side(ins),
            "outputs": side(outs),
            "attrs": [{"name": "op_schema", "value": schema}],
        }

    bf16, fp32, same = (
        [1, 100, 0, 8, 2, "cuda"],
        [2, 200, 0, 8, 4, "cuda"],
        [3, 100, 0, 8, 2, "cuda"],
    )
    nodes = [node(10, [bf16], [fp32]), node(11, [bf16], [same])]
    assert alias_storage(nodes)
    src = nodes[0]["inputs"]["values"][0][1]
    assert nodes[0]["outputs"]["values"][0][1] != src  # the float32 copy: its own memory
    assert nodes[1]["outputs"]["values"][0][1] == src  # no conversion: the input itself
