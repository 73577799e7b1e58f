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


def run(trace, n, par, symmetry, topology=None):
    topology = topology or {"kind": "switch", "bandwidth": 50 * GB, "latency": 1e-6}
    cfg = {
        "num_gpus": n,
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


def test_a_ring_on_a_ring_topology_is_still_the_exact_run():
    # 4 CP ranks on a ring of links: each rank's send to the next crosses its own link,
    # as each image's does; the copies are the ring's rotations
    t = attention_trace(b=2, s=256, layers=2, H=8, d=64)
    ring = {"kind": "ring", "bandwidth": 20 * GB, "latency": 2e-6}
    par = {"cp": 4, "cp_comm": "p2p"}
    exact, sym = run(t, 4, par, "off", ring), run(t, 4, par, "auto", ring)
    assert sym.symmetry == "auto: 1 representative of 4 GPUs"
    assert sym.iteration_time == pytest.approx(exact.iteration_time, rel=1e-12)
