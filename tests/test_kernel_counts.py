"""Shape-only traces count kernels as real ones do (issue 46; perfmodel/kernel_counts.py):
a shape-only run launches nothing, so its operators take the real H100 traces' kernel
count per operator name, what the host model charges a launch for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from perfmodel.kernel_counts import TRACES, build, count_kernels, table
from triosim.trace.model import Trace, load

ROOT = Path(__file__).resolve().parents[1]


def _real() -> dict[str, Trace]:
    files = sorted(TRACES.glob("*.trace.json.gz")) + sorted(
        (TRACES / "imported").glob("*.trace.json.gz")
    )
    return {str(f.relative_to(TRACES)): load(f) for f in files}


@pytest.fixture(scope="module")
def real():
    return _real()


def _family(path: str) -> str:
    return Path(path).name.split("-")[0]  # resnet50-b64.trace.json.gz -> resnet50


def test_the_shipped_table_is_the_real_traces_medians(real):
    # regenerate with python -m perfmodel.kernel_counts when the traces change
    assert table() == build(real.values())


# how close a table without the model counts its kernels: within 15 %, but for the models
# whose convolutions (3x3 at 224 px, wide channels: VGG, ResNet-18's basic blocks) launch
# more kernels than the other models' convolutions of the same name (measured: ResNet-18
# b128 -22 %, VGG-11/13/16 -26 to -36 %); the leaf counts a shape-only run gave before were
# +22 to +130 % off for the others
WITHIN = {"resnet50": 0.15, "resnet152": 0.15, "densenet121": 0.15, "gpt2": 0.15, "bert": 0.15}
WITHIN |= {"resnet18": 0.25, "vgg11": 0.4, "vgg13": 0.4, "vgg16": 0.4}


@pytest.mark.parametrize("model", sorted(WITHIN))
def test_a_table_without_the_model_counts_its_kernels(real, model):
    # fitted on the other models' traces (their tracer and imported traces alike), checked
    # on this one's: its operators renamed nothing, only their counts replaced
    others = build(t for p, t in real.items() if _family(p) != model)
    mine = {p: t for p, t in real.items() if _family(p) == model and "/" not in p}
    assert mine
    for path, t in mine.items():
        ops = [dataclasses.replace(o) for o in t.operators]
        known = count_kernels(Trace(ops, t.tensors, t.metadata), others)
        assert known >= 0.8 * len(ops), path
        got, want = sum(o.kernels for o in ops), sum(o.kernels for o in t.operators)
        assert got == pytest.approx(want, rel=WITHIN[model]), path


def test_a_shape_only_trace_takes_the_real_counts():
    pytest.importorskip("torch")
    from perfmodel.modelled import model_times
    from tracer.cli import trace_model

    t = trace_model("resnet18", 2, small=True, image_size=32, shapes_only=True)
    leaves = {(o.phase, o.name): o.kernels for o in t.operators}
    model_times(t, "H100-SXM", "calibrated")
    counts = table()
    known = [o for o in t.operators if (o.phase, o.name) in counts]
    assert len(known) >= 0.9 * len(t.operators)
    assert all(o.kernels == counts[(o.phase, o.name)] for o in known)
    # the optimizer's item() on a CPU step count: a leaf on the meta run, no kernel on a GPU
    assert leaves[("optimizer", "aten::item")] == 1
    assert {o.kernels for o in t.operators if o.name == "aten::item"} == {0}
    assert t.metadata["kernels_source"].startswith(f"{len(known)} of {len(t.operators)}")
