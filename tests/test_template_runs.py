"""A stage template's compute runs: each sequence of computes is made into a ComputeRun
once and shared by every micro-batch's copy (ComputeRun.at_mb), so each copy must still
say which micro-batch its computes belong to (the memory model keeps each micro-batch's
activations apart by it) and give the same tasks as computes made one by one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extrapolators.execution.tasks import Compute, ComputeRun
from extrapolators.modes.mesh.template import GRADS, SIGNAL
from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation


def test_a_copy_at_another_micro_batch_shares_columns_and_makes_its_tasks():
    tasks = [
        Compute(f"op{i}", "l", "forward", 1e-3 * (i + 1), i, 0, 1e-6, i == 1) for i in range(3)
    ]
    base = ComputeRun(tasks)
    copy = ComputeRun.at_mb(base, 5)
    assert copy.durations is base.durations and copy.names is base.names
    assert copy.mbs == [5, 5, 5] and base.mbs == [0, 0, 0]
    assert len(copy) == 3 and copy.syncs == [1]
    assert copy.tasks == tuple(dataclasses.replace(c, mb=5) for c in tasks)
    assert base.tasks == tuple(tasks)  # the base's own tasks untouched


@pytest.mark.parametrize(
    "par",
    [
        {"pp": 2, "tp": 2, "microbatches": 4, "schedule": "1f1b", "recompute": "full"},
        {"pp": 2, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2},
        {"pp": 2, "dp_shard": 2, "microbatches": 3, "schedule": "zb1p"},
    ],
)
def test_every_run_in_a_step_is_at_the_steps_micro_batch(par):
    """Walking the stage's schedule: each F or B step ends with the signal `{F|B}{m}.{chunk}`
    and a W step is one run; every compute of the step's runs is at micro-batch m (a shared
    run left at micro-batch 0, or at another step's, would fail); the optimizer's run,
    after the last step, at 0."""
    n = 2 * par.get("tp", 1) * par.get("dp_shard", 1)
    cfg = {
        "num_gpus": n,
        "batch_size": 24,
        "parallelism": {"mode": "mesh", **par},
        "topology": {"kind": "ring", "bandwidth": 1e10, "latency": 0.0},
        "communication": {"kind": "textbook"},
    }
    sim = Simulation(cfg, trace=chain_trace(layers=4))
    mode = sim.extrapolator
    checked = 0
    for p in range(2):
        items, k = mode.builder.template(p).items, 0
        for kind, m, _ in mode.orders[p]:
            if kind == "W":  # the weight gradients a split backward left: a run (split
                # where the step completes units' gradients: their signals, no step signal)
                assert type(items[k]) is ComputeRun
                runs, k = [items[k]], k + 1
                while k < len(items) and type(items[k]) is tuple and items[k][0] == GRADS:
                    k += 1
                    if type(items[k]) is ComputeRun:
                        runs.append(items[k])
                        k += 1
            else:
                end = next(
                    i
                    for i in range(k, len(items))
                    if type(items[i]) is tuple and items[i][0] == SIGNAL
                )
                assert items[end][1].startswith(f"{kind}{m}.")
                runs, k = [x for x in items[k:end] if type(x) is ComputeRun], end + 1
            for run in runs:
                assert run.mbs == [m] * len(run)
                assert [c.mb for c in run.tasks] == run.mbs
                checked += len(run)
        rest = [x for x in items[k:] if type(x) is ComputeRun]
        assert rest and all(run.mbs == [0] * len(run) for run in rest)
    assert checked > 0
    # the runs of one micro-batch's steps and another's: the same operators and times
    runs = [x for x in mode.builder.template(0).items if type(x) is ComputeRun]
    by_mb = {}
    for run in runs:
        by_mb.setdefault(run.mbs[0], []).append(run)
    first, second = by_mb[0], by_mb[1]
    assert [r.names for r in first[: len(second)]] == [r.names for r in second[: len(first)]]
    assert all(
        np.array_equal(a.durations, b.durations) for a, b in zip(first, second, strict=False)
    )


def _items(mode, p):
    """A template's contents to compare: runs as their tasks, other items as they are."""
    t = mode.builder.template(p)
    items = [("run", x.tasks, tuple(x.mbs)) if type(x) is ComputeRun else x for x in t.items]
    return items, t.entries, t.reduce_order, t.side


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    dp_shard=st.sampled_from([1, 2]),
    micro=st.integers(1, 4),
    schedule=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb1p"]),
    recompute=st.sampled_from(["none", "full", "selective"]),
    sp=st.booleans(),
    dopt=st.sampled_from([None, "after", "overlap"]),
)
@example(
    pp=2, tp=1, dp_shard=1, micro=2, schedule="1f1b", recompute="none", sp=False, dopt="overlap"
)
@example(pp=1, tp=2, dp_shard=2, micro=2, schedule="1f1b", recompute="full", sp=True, dopt=None)
def test_plain_stretches_give_the_templates_of_one_operator_at_a_time(
    pp, tp, dp_shard, micro, schedule, recompute, sp, dopt
):
    """A walk's plain stretches (operators that add only their compute task) are added as
    tasks made once; taken one operator at a time instead, every template is the same:
    its items (each run's tasks and micro-batches), FSDP entries, reduce order."""
    from extrapolators.modes.mesh import template

    par = {"pp": pp, "tp": tp, "dp_shard": dp_shard, "microbatches": micro * pp}
    par |= {"schedule": schedule if pp > 1 else "1f1b", "recompute": recompute}
    if schedule == "interleaved" and pp > 1:
        par["virtual_stages"] = 2
    if tp > 1:
        par["sequence_parallel"] = sp
    if dopt and dp_shard == 1:  # Megatron's distributed optimizer over 2 replicas (its
        # parameter gathers waited for where the next forward reads them: `overlap`)
        par |= {"dp_replicate": 2, "distributed_optimizer": True}
        par["overlap_param_gather"] = dopt == "overlap"
    cfg = {
        "num_gpus": pp * tp * dp_shard * par.get("dp_replicate", 1),
        "batch_size": 8 * micro * pp * dp_shard * par.get("dp_replicate", 1),
        "parallelism": {"mode": "mesh", **par},
        "topology": {"kind": "ring", "bandwidth": 1e10, "latency": 0.0},
        "communication": {"kind": "textbook"},
    }
    got = {}
    for plain in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(template, "PLAIN_STRETCHES", plain)
            mode = Simulation(cfg, trace=chain_trace(layers=8)).extrapolator
            got[plain] = [_items(mode, p) for p in range(pp)]
    assert got[True] == got[False]
