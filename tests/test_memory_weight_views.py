"""The memory model's activations where a backward pass is split or returns a weight's view
(triosim/results/memory.py): a storage that holds a weight's cast is no activation, and the
weight gradient a split backward makes is born with its W part. By hand."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import chain_trace
from triosim.results.memory import CATEGORIES, _activations, activation_plan
from triosim.trace.model import Tensor


class _One:
    def activation_ratio(self, op):
        return 1.0


def test_a_weights_view_returned_by_a_backward_op_is_no_activation():
    """A chain's last backward op also returns a view of its weight's bfloat16 cast (as a
    product's backward returns the weight it saved; the tracer labels it an activation):
    the storage holds a buffer, so the plan has no allocation for it. A view of an
    activation's storage stays one."""
    t = chain_trace(layers=2, t_opt=0)
    cast = Tensor(len(t.tensors), (64, 16), "bfloat16", 2048.0, "buffer", storage=900)
    view = Tensor(len(t.tensors) + 1, (16, 64), "bfloat16", 2048.0, "activation", storage=900)
    act = Tensor(len(t.tensors) + 2, (8, 8), "bfloat16", 128.0, "activation", storage=901)
    for x in (cast, view, act):
        t.tensors[x.id] = x
    bwd = [op for op in t.operators if op.phase == "backward"][-1]
    bwd.outputs = (*bwd.outputs, view.id, act.id)
    keys = {k for items, _ in activation_plan(t, _One()).values() for k, *_ in items}
    assert ("s", 900, "bfloat16") not in keys
    assert ("s", 901, "bfloat16") in keys


def test_a_split_backwards_weight_gradient_is_born_with_its_w_part():
    """One operator run twice in a micro-batch (its B part 0-1 ms, its W part 5-6 ms): an
    input it reads lives from 0 to 6 ms, an output it makes in its W part (late) from 5
    to 6 ms, another output from 0 to 6 ms."""
    rows = {
        "op_id": [7, 7],
        "start": [0.0, 5e-3],
        "end": [1e-3, 6e-3],
        "iteration": [0, 0],
        "microbatch": [0, 0],
        "phase": ["backward", "backward"],
    }
    items = [
        ("x", 10.0, False, None, False, True, False),  # read (the activation W needs)
        ("dx", 20.0, True, None, False, False, False),  # made in B
        ("dw", 30.0, True, None, False, False, True),  # made in W
    ]
    times, cats, values = [], [], []
    _activations(rows, {7: (items, 1.0)}, times, cats, values)
    times, cats, values = (np.concatenate(x).tolist() for x in (times, cats, values))
    k = CATEGORIES.index("activations")
    assert cats == [k] * 6
    got = {v: t for t, v in zip(times, values, strict=True)}
    assert (got[10.0], got[-10.0]) == (0.0, 6e-3)
    assert (got[20.0], got[-20.0]) == (0.0, 6e-3)
    assert (got[30.0], got[-30.0]) == pytest.approx((5e-3, 6e-3))


def test_activation_copies_by_hand_in_the_order_they_are_made():
    """Rows of two micro-batches, by hand: op 1 (forward) makes "a" and saves "s" inside
    itself (its maker, op 1); op 2 (recompute, micro-batch 0) writes "a" again (the
    recomputed copy); op 3 (backward) reads "a" and "s". Op 3 of micro-batch 1 runs
    before any op 1 of micro-batch 1, so its "s" is born with it (nothing made it yet).
    The copies come out in the order their first rows made them."""
    rows = {
        "op_id": [1, 3, 2, 3, 1],
        "start": [0.0, 1.0, 2.0, 3.0, 4.0],
        "end": [0.5, 1.5, 2.5, 3.5, 4.5],
        "iteration": [0, 0, 0, 0, 0],
        "microbatch": [0, 1, 0, 0, 1],
        "phase": ["forward", "backward", "recompute", "backward", "forward"],
    }
    plan = {
        1: ([("a", 10.0, True, None, False, False, False)], 1.0),
        2: ([("a", 10.0, True, None, False, False, False)], 1.0),
        3: (
            [
                ("a", 10.0, False, None, False, True, False),
                ("s", 5.0, False, 1, False, True, False),
            ],
            2.0,
        ),
    }
    times, cats, values = [], [], []
    _activations(rows, plan, times, cats, values)
    times, values = (np.concatenate(x).tolist() for x in (times, values))
    assert list(zip(times[::2], times[1::2], values[::2], strict=True)) == [
        (0.0, 0.5, 10.0),  # a, mb 0, op 1's copy: to its last forward reader
        (1.0, 4.5, 20.0),  # a, mb 1: read by op 3 first (ratio 2), op 1 extends it
        (1.0, 1.5, 10.0),  # s, mb 1: its maker had not run: born with its reader
        (2.0, 3.5, 10.0),  # a, mb 0, recomputed copy: op 2 to op 3
        (0.0, 3.5, 10.0),  # s, mb 0: born with op 1's first run
    ]
    assert values[1::2] == [-v for v in values[::2]]
