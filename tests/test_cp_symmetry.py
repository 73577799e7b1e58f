"""Context parallelism as a symmetry axis (issue 43): CP ranks do the same work, so a
symmetric run without data parallelism keeps one of them; ring attention's sends then go to an image of the sender
(extrapolators.execution.symmetry: a send to an image ends at the instant its image, the
representative's receive, does). The symmetric run is the exact run, to the digit."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_context_parallel import attention_trace

from triosim.simulation.wiring import Simulation

GB = 1e9


def run(trace, n, par, symmetry, topology=None, iterations=1):
    topology = topology or {"kind": "switch", "bandwidth": 50 * GB, "latency": 1e-6}
    cfg = {
        "num_gpus": n,
        "iterations": iterations,
        "topology": topology,
        "parallelism": {"mode": "mesh", **par},
        "communication": {"kind": "textbook"},
        "symmetry": symmetry,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: it must not fall back
        return Simulation(cfg, trace=trace).run()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cp=st.sampled_from([2, 4]),
    comm=st.sampled_from(["p2p", "a2a"]),
    dp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    fsdp=st.booleans(),
)
def test_a_symmetric_cp_run_is_the_exact_run(cp, comm, dp, tp, pp, fsdp):
    n = cp * dp * tp * pp
    par = {"cp": cp, "cp_comm": comm, "tp": tp, "pp": pp}
    par["dp_shard" if fsdp else "dp_replicate"] = dp
    if pp > 1:
        par["microbatches"] = 2
    t = attention_trace(b=2 * dp * (2 if pp > 1 else 1), s=256, layers=2, H=8, d=64)
    exact = run(t, n, par, "off")
    sym = run(t, n, par, "auto")
    # one GPU per pipeline stage; with data parallelism CP's ranks are kept (the
    # data-parallel groups fold CP in: mesh/symmetry.py)
    reps = n // (cp * dp * tp) if dp == 1 else n // (dp * tp)
    assert sym.symmetry == f"auto: {reps} representative{'s' * (reps > 1)} of {n} GPUs"
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    assert sym.per_gpu()["compute"].tolist() == pytest.approx(
        exact.per_gpu()["compute"].tolist(), rel=1e-12
    )
    assert sym.bytes_delivered == pytest.approx(exact.bytes_delivered, rel=1e-12)


def test_a_ring_on_a_ring_topology_is_still_the_exact_run_every_iteration():
    # 4 CP ranks on a ring of links: each rank's send to the next crosses its own link,
    # as each image's does; the copies are the ring's rotations. Three iterations: the
    # keys of iterations 1 and 2 carry their prefix ("it1/"), the waits on an image's
    # signal too
    t = attention_trace(b=2, s=256, layers=2, H=8, d=64)
    ring = {"kind": "ring", "bandwidth": 20 * GB, "latency": 2e-6}
    par = {"cp": 4, "cp_comm": "p2p"}
    exact, sym = run(t, 4, par, "off", ring, 3), run(t, 4, par, "auto", ring, 3)
    assert sym.symmetry == "auto: 1 representative of 4 GPUs"
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
    assert sym.first_iteration_time == pytest.approx(exact.first_iteration_time, rel=1e-12)


def test_cp_groups_that_snake_across_hosts_keep_their_ranks():
    # TP 4 x CP 4 on two hosts of 8: the CP group of GPU 0 in the topology's ring order is
    # [0, 4, 12, 8], which no CP shift maps onto itself: CP's ranks are kept (TP's copies
    # only), without an attempt that falls back (a fallback warns: an error here)
    t = attention_trace(b=2, s=256, layers=2, H=8, d=64)
    nodes = {"kind": "multi_node", "gpus_per_node": 8, "bandwidth": 450 * GB,
             "latency": 1e-6, "inter_bandwidth": 50 * GB}  # fmt: skip
    par = {"cp": 4, "cp_comm": "p2p", "tp": 4}
    exact, sym = run(t, 16, par, "off", nodes), run(t, 16, par, "auto", nodes)
    assert sym.symmetry == "auto: 4 representatives of 16 GPUs"
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
