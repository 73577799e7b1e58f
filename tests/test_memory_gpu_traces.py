"""Issue 32's memory target on the real GPU traces (../shared/gpu, the tracer's traces of
the H100 and H200 with `torch.cuda.max_memory_allocated`): each trace's one-GPU peak, and
that of its shape-only twin (traced here on meta tensors), within 5 % of the measurement.
Nothing in the memory model is fitted to these peaks: its rules are PyTorch's (saved
tensors born with their forward operator, cuBLAS workspaces by CublasHandlePool.cpp's
defaults; docs/memory.md), so every model here is held out."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "gpu"
TRACES = sorted(SHARED.glob("h*/traces/*.trace.json.gz")) if SHARED.is_dir() else []
needs_shared = pytest.mark.skipif(not TRACES, reason="needs ../shared/gpu (the real traces)")
# the twins that were furthest off before the saved-tensor rule and the start-order fix
# (VGG-11 -18.5 %, ResNet-18 -10.2 %, GPT-2 +1.0 % high by a task overlap of one ulp)
TWINS = ("h100/traces/vgg11-b128", "h100/traces/resnet18-b128", "h100/traces/gpt2-s512-b8")


def _name(p: Path) -> str:
    return f"{p.parent.parent.name}/{p.name.split('.')[0]}"


def _peak(trace) -> float:
    from triosim.simulation.wiring import Simulation

    cfg = {"num_gpus": 1, "batch_size": trace.batch_size, "parallelism": {"mode": "single"}}
    return Simulation(cfg, trace=trace).run().peak_memory[0]


@pytest.mark.no_cover
@needs_shared
@pytest.mark.parametrize("path", TRACES, ids=_name)
def test_real_gpu_trace_peak_within_5_percent(path):
    from triosim.trace.model import load

    t = load(path)
    measured = t.metadata["peak_memory_bytes"]
    assert "cuda" in t.metadata["peak_memory_source"]
    assert _peak(t) == pytest.approx(measured, rel=0.05)


@needs_shared
@pytest.mark.parametrize("name", TWINS)
def test_shape_only_twin_peak_within_5_percent(name, tmp_path):
    pytest.importorskip("torch")
    from benchmarks.shape_twins import twin
    from perfmodel.modelled import model_times
    from triosim.trace.model import load

    real = load(SHARED / f"{name}.trace.json.gz")
    shapes = model_times(twin(real, cache=tmp_path), real.metadata["gpu"], "learned")
    measured = real.metadata["peak_memory_bytes"]
    predicted = _peak(shapes)
    assert predicted == pytest.approx(measured, rel=0.05)
    # the twin holds what the real trace holds: the same peak to 0.1 %
    assert predicted == pytest.approx(_peak(real), rel=1e-3)
