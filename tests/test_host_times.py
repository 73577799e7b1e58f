"""The trace's host columns (format 2): a hand-made Execution Trace + Kineto pair whose host
spans, launch calls and kernels are known, imported to known host times and a known
idle-time breakdown (tracer/host_times.py, triosim.trace.model.host_stats); old files
without the columns load; the columns are validated.

The pair, microseconds on one clock (ProfilerStep#1 at 0):

    op  node  name (thread)            host span    launch  GPU work      idle before  host wait
    A   4     aten::relu (main)        10 +50       20      30..130       -            -
    B   5     aten::mul (main)         60 +200      240     250..270      120          110 (240-130)
    C   6     aten::item (main)        260 +40      265     275..280 DtoH 5            0 (launched at 265)
              7  _local_scalar_dense on cuda:0, cudaStreamSynchronize at 282
    D   8     aten::add (main)         300 +30      310     400..450      120          30 (310-280)
    E   21    evaluate_function: MulBackward0 (autograd thread)
                                       500 +100     510     520..530      70           60 (510-450)

GPU time 185, idle 315 (host wait 200, kernel gap 115), span 30..530 = 500; host time 420.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.test_profile_import import _node, _side, write
from tracer.profile_import import import_profile
from triosim.common.errors import TraceError
from triosim.trace.model import host_stats, load, save

BWD = "autograd::engine::evaluate_function: "
US = 1e-6
# node id, name, parent, thread, host (ts, dur), inputs, outputs
NODES = [
    (3, "ProfilerStep#1", 2, 1, (0, 1000), None, None),
    (4, "aten::relu", 3, 1, (10, 50), _side("x"), _side("y")),
    (5, "aten::mul", 3, 1, (60, 200), _side("y"), _side("z")),
    (6, "aten::item", 3, 1, (260, 40), _side("z"), None),
    (7, "aten::_local_scalar_dense", 6, 1, (262, 30), _side("z"), None),
    (8, "aten::add", 3, 1, (300, 30), _side("z"), _side("gz")),
    (21, BWD + "MulBackward0", 20, 2, (500, 100), None, None),
    (22, "aten::mul", 21, 2, (505, 90), _side("gz", "y"), _side("gy")),
]
# (node id launching it, runtime call, launch ts, GPU category, GPU name, start, duration)
LAUNCHES = [
    (4, "cudaLaunchKernel", 20, "kernel", "relu", 30, 100),
    (5, "cudaLaunchKernel", 240, "kernel", "mul", 250, 20),
    (7, "cudaMemcpyAsync", 265, "gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 275, 5),
    (8, "cudaLaunchKernel", 310, "kernel", "add", 400, 50),
    (22, "cudaLaunchKernel", 510, "kernel", "mul", 520, 10),
]


def make_host_pair() -> tuple[dict, dict]:
    nodes = [
        _node(1, "[pytorch|profiler|execution_trace|process]", 0, 0),
        _node(2, "[pytorch|profiler|execution_trace|thread]", 1, 0),
        _node(20, "[pytorch|profiler|execution_trace|thread]", 1, 0),
    ]
    events = []
    for i, name, parent, tid, (ts, dur), ins, outs in NODES:
        nodes.append(_node(i, name, parent, i, -1, ins, outs))
        cat = "cpu_op" if "::" in name else "user_annotation"
        args = {"External id": 1000 + i, "Record function id": i}
        events.append(dict(ph="X", cat=cat, name=name, pid=99, tid=tid, ts=ts, dur=dur, args=args))
    for corr, (i, call, launch, cat, kname, start, dur) in enumerate(LAUNCHES, 1):
        ext = {"External id": 1000 + i, "correlation": corr}
        tid = 2 if i == 22 else 1
        events.append(
            dict(ph="X", cat="cuda_runtime", name=call, pid=99, tid=tid, ts=launch, dur=3, args=ext)
        )
        events.append(dict(ph="X", cat=cat, name=kname, pid=0, tid=7, ts=start, dur=dur, args=ext))
    sync = {"External id": 1007, "correlation": 99}
    events.append(
        dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", pid=99, tid=1, ts=282,
             dur=5, args=sync)
    )  # fmt: skip
    et = {"schema": "1.1.1-chakra.0.0.4", "pid": 99, "nodes": nodes}
    return et, {"traceEvents": events}


@pytest.fixture
def imported(tmp_path):
    et, kineto = make_host_pair()
    a = write(tmp_path / "h.et.json", et)
    b = write(tmp_path / "h.kineto.json", kineto)
    return import_profile(a, b, batch_size=2, gpu="H100-SXM", torch_flops=False)


def test_host_columns_of_a_known_pair(imported):
    ops = {o.id: o for o in imported.operators}
    assert list(ops) == [4, 5, 6, 8, 21]
    want = {  # id: (host_time, host_start, sync, gpu_idle, host_wait, GPU time), microseconds
        4: (50, 0, False, 0, 0, 100),
        5: (200, 50, False, 120, 110, 20),
        6: (40, 250, True, 5, 0, 5),
        8: (30, 290, False, 120, 30, 50),
        21: (100, 490, False, 70, 60, 10),
    }
    for i, (host, start, sync, idle, wait, gpu) in want.items():
        o = ops[i]
        got = (o.host_time, o.host_start, o.sync, o.gpu_idle, o.host_wait, o.time)
        assert got == pytest.approx((host * US, start * US, sync, idle * US, wait * US, gpu * US))


def test_host_stats_of_a_known_pair(imported, tmp_path):
    want = {
        "operators": 5,
        "operators_with_host_time": 5,
        "sync_operators": 1,
        "gpu_time": 185 * US,
        "host_time": 420 * US,
        "gpu_idle": 315 * US,
        "host_wait": 200 * US,
        "kernel_gap": 115 * US,
        "gpu_span": 500 * US,
        "idle_share": 0.63,
        "host_wait_share": 0.40,
        "kernel_gap_share": 0.23,
    }
    assert host_stats(imported) == pytest.approx(want)
    # the columns survive a save and a load
    again = load(save(imported, tmp_path / "h.trace.json"))
    assert host_stats(again) == pytest.approx(want)
    assert json.loads((tmp_path / "h.trace.json").read_text())["format_version"] == 2


def _old_doc() -> dict:
    """A format-1 trace, written before the host columns existed."""
    return {
        "format": "triosim-trace",
        "format_version": 1,
        "metadata": {"batch_size": 2},
        "tensors": {
            "columns": ["id", "shape", "dtype", "nbytes", "category"],
            "rows": [[0, [2, 3], "float32", 24.0, "input"]],
        },
        "operators": {
            "columns": ["id", "name", "layer", "phase", "time", "inputs", "outputs", "flops"],
            "rows": [[1, "aten::relu", "a", "forward", 0.001, [0], [0], None]],
        },
    }


def test_old_trace_without_host_columns_loads(tmp_path):
    t = load(write(tmp_path / "old.trace.json", _old_doc()))
    o = t.operators[0]
    assert (o.host_time, o.host_start, o.sync, o.gpu_idle, o.host_wait) == (
        None,
        None,
        False,
        None,
        None,
    )
    s = host_stats(t)
    assert s["gpu_time"] == pytest.approx(0.001)
    assert s["host_time"] is None and s["host_wait_share"] is None
    assert s["operators_with_host_time"] == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("host_time", -1e-6),
        ("host_time", math.inf),
        ("host_start", math.nan),
        ("gpu_idle", -0.5),
        ("host_wait", "1"),
        ("sync", 1),
    ],
)
def test_bad_host_column_names_the_field(tmp_path, field, value):
    doc = _old_doc()
    doc["format_version"] = 2
    ops = doc["operators"]
    ops["columns"].append(field)
    ops["rows"][0].append(value)
    with pytest.raises(TraceError, match=field):
        load(write(tmp_path / "bad.trace.json", doc))


def test_host_wait_above_gpu_idle_is_refused(imported):
    op = imported.operators[1]
    op.host_wait = op.gpu_idle * 2
    with pytest.raises(TraceError, match="host_wait"):
        imported.validate()
    op.host_wait, op.host_time = 0.0, -1.0
    with pytest.raises(TraceError, match="host_time"):
        imported.validate()


@pytest.mark.parametrize("keep", ["et", "runtime", "memcpy", None])
def test_each_sync_source_alone_marks_the_operator(tmp_path, keep):
    """item() on a GPU tensor in the ET, a blocking runtime call, a device-to-host copy:
    each alone makes operator C synchronising; item() on a CPU tensor (Adam's step count)
    with none of the others does not."""
    et, kineto = make_host_pair()
    if keep != "et":
        node = next(n for n in et["nodes"] if n["id"] == 7)
        node["inputs"]["values"][0][5] = "cpu"
    events = kineto["traceEvents"]
    if keep != "runtime":
        events[:] = [e for e in events if e["name"] != "cudaStreamSynchronize"]
    if keep != "memcpy":
        next(e for e in events if e["cat"] == "gpu_memcpy")["name"] = "Memcpy HtoD"
    a, b = write(tmp_path / "s.et.json", et), write(tmp_path / "s.kineto.json", kineto)
    t = import_profile(a, b, batch_size=2, torch_flops=False)
    assert [o.id for o in t.operators if o.sync] == ([6] if keep else [])


def test_info_prints_the_host_breakdown_or_says_it_is_unknown(capsys):
    """`triosim info` shows host_stats where the trace has host columns, 'unknown' where not."""
    from triosim.cli.main import main
    from triosim.trace.files import load_any_trace
    from triosim.trace.model import host_stats

    path = "traces/h100/imported/densenet121-b64.trace.json.gz"
    h = host_stats(load_any_trace(path))
    assert main(["info", path]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host "))
    assert f"host wait {100 * h['host_wait_share']:.1f} %" in line
    assert f"GPU {h['gpu_time'] * 1e3:.2f} ms" in line
    assert main(["info", "traces/cpu/resnet18-b8.trace.json.gz"]) == 0
    out = capsys.readouterr().out
    assert "host          unknown (a trace without host columns)" in out
