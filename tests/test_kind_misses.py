"""benchmarks/kind_misses.py: the split of a family by what the learned model's features
lack, and the table's sums and errors by hand."""

import numpy as np

from benchmarks.kind_misses import misses, split_of
from triosim.trace.model import Operator, Tensor, Trace


def _trace():
    t = {
        0: Tensor(0, (8, 3, 32, 32), "float32", 98304, "input"),
        1: Tensor(1, (16, 3, 7, 7), "float32", 9408, "weight"),
        2: Tensor(2, (8, 16, 32, 32), "float32", 524288, "activation"),
        3: Tensor(3, (16, 16, 1, 1), "float32", 1024, "weight"),
        4: Tensor(4, (8, 16, 32, 32), "float32", 524288, "activation"),
    }
    ops = [
        Operator(0, "aten::conv2d", "stem", "forward", 4e-3, (0, 1), (2,), 1e9),
        Operator(1, "aten::conv2d", "c1", "forward", 1e-3, (2, 3), (4,), 1e8),
        Operator(2, "aten::mul", "m", "forward", 2e-3, (4, 4), (4,), 1e6),
    ]
    return Trace(ops, t, {"batch_size": 8, "gpu": "H100-SXM"}).validate()


def test_split_of_names_kernel_stem_and_operator():
    t = _trace()
    assert split_of(t, t.operators[0], "conv") == "7x7 kernel, 3-channel input (stem)"
    assert split_of(t, t.operators[1], "conv") == "1x1 kernel"
    assert split_of(t, t.operators[2], "elementwise") == "mul"


def test_misses_table_by_hand():
    t = _trace()
    # predicted: the stem 2 ms (-50 %), the 1x1 conv 1.5 ms (+50 %): conv 5 -> 3.5 ms, -30 %;
    # mul 2.05 ms: +2.5 %, within 5 %, so not listed
    preds = {"x": (np.array([2e-3, 1.5e-3, 2.05e-3]), None)}
    rows = misses({"x": t}, preds)
    assert rows[2] == "| **conv** | all | 5.0 | 3.5 | -30.0 | |"
    assert rows[3] == "| | 7x7 kernel, 3-channel input (stem) | 4.0 | 2.0 | -50.0 | 1 |"
    assert rows[4] == "| | 1x1 kernel | 1.0 | 1.5 | +50.0 | 1 |"
    assert len(rows) == 5  # no elementwise rows
