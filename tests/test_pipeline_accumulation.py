"""Gradient accumulation around the pipeline (`parallelism.accumulation`, the mesh): K
pipeline schedules an iteration, each over M / K micro-batches, as torchtitan and NeMo
Automodel run gradient accumulation with pp > 1 (each schedule fills and drains; FSDP
gathers the parameters again for each; the gradients are reduced once, after the last)."""

from __future__ import annotations

import pytest

from tests.conftest import chain_trace
from tests.test_threed import FAST, sim, t_iter
from triosim.common.errors import ConfigError

S, M = 4, 8
f, b = 1e-3 / 8, 2e-3 / 8  # a layer's forward and backward per micro-batch (batch 8 of 1)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_each_schedule_fills_and_drains_by_hand(K):
    """1F1B over S stages of one layer: one schedule of m micro-batches takes (m + S - 1)
    (f + b); K of them over M / K each take K (M / K + S - 1)(f + b) = (M + K (S - 1))
    (f + b): K bubbles. Interleaved with v = 2 chunks of a layer a stage: M v (f + b) +
    K (S - 1)(f + b)."""
    t = chain_trace(layers=S, t_opt=0, batch=8)
    got = t_iter(t, S, "mesh", pp=S, microbatches=M, accumulation=K)
    assert got == pytest.approx((M + K * (S - 1)) * (f + b), rel=1e-9)
    # interleaved: M2 = 16 micro-batches of one sample (each schedule's a multiple of S)
    M2, f2, b2 = 16, 1e-3 / 16, 2e-3 / 16
    t2 = chain_trace(layers=2 * S, t_opt=0, batch=16)
    got = t_iter(
        t2, S, "mesh", pp=S, microbatches=M2, accumulation=K, schedule="interleaved",
        virtual_stages=2,
    )  # fmt: skip
    assert got == pytest.approx(M2 * 2 * (f2 + b2) + K * (S - 1) * (f2 + b2), rel=1e-9)


def test_fsdp_gathers_again_for_each_schedule_and_reduces_once():
    """FSDP x PP (2 x 2), units never resharded after forward: each schedule gathers every
    unit of its stage once (K times in all); the reduce-scatters run once, after the last
    schedule's backward, whatever K."""
    t = chain_trace(layers=4, t_opt=0, batch=8)
    counts = {}
    for K in (1, 2):
        r = sim(
            t, 4, "mesh", FAST, pp=2, dp_shard=2, microbatches=4, accumulation=K,
            reshard_after_forward="never",
        ).run()  # fmt: skip
        tl = r.timeline
        mine = tl[(tl["gpu"] == 0) & (tl["kind"] == "comm")]
        counts[K] = mine["name"].value_counts().to_dict()
        last_b = tl[(tl["gpu"] == 0) & (tl["phase"] == "backward") & (tl["kind"] == "compute")]
        rs = mine[mine["name"] == "reduce_scatter"]
        assert rs["start"].min() >= last_b[last_b["microbatch"] < 4 // K]["end"].min()
        assert (rs["start"] >= last_b[last_b["microbatch"] >= 4 - 4 // K]["start"].min()).all()
    assert counts[1]["all_gather"] > 0
    assert counts[2]["all_gather"] == 2 * counts[1]["all_gather"]
    assert counts[2]["reduce_scatter"] == counts[1]["reduce_scatter"]


@pytest.mark.parametrize(
    "par, match",
    [
        ({"pp": 1, "microbatches": 4, "accumulation": 2}, "accumulation.*1 with pp 1"),
        ({"pp": 4, "microbatches": 8, "accumulation": 3}, "accumulation.*divisor of microbatches"),
        (
            {
                "pp": 4,
                "microbatches": 8,
                "accumulation": 4,
                "schedule": "interleaved",
                "virtual_stages": 2,
            },
            r"accumulation.*microbatches / accumulation = 2.*multiple of the pipeline depth",
        ),
    ],
)
def test_bad_accumulation_names_the_field(par, match):
    with pytest.raises(ConfigError, match=match):
        sim(chain_trace(layers=4), 4, "mesh", batch_size=16, **par)


def test_each_schedules_last_micro_batch_skips_the_recomputation():
    """`recompute_microbatches: except_last` (torch Pipe's checkpoint='except_last'): with
    2 schedules of 4 micro-batches, micro-batches 3 and 7 run their backward without
    recomputing; the others recompute."""
    t = chain_trace(layers=4, t_opt=0, batch=8)
    tl = sim(
        t, 2, "mesh", FAST, pp=2, microbatches=8, accumulation=2, recompute="full",
        recompute_microbatches="except_last",
    ).run().timeline  # fmt: skip
    again = tl[(tl["gpu"] == 0) & (tl["phase"] == "recompute")]
    assert sorted(set(again["microbatch"])) == [0, 1, 2, 4, 5, 6]
