"""benchmarks/same_results: what its fingerprints see, so a refactor that changes an output
is caught (the summary, the network's counters, the links and the transfers included)."""

from __future__ import annotations

import copy

import pytest

from benchmarks.same_results import _outputs_sha256, _same, configs, fingerprint


@pytest.fixture(scope="module")
def ddp():
    from triosim.simulation.wiring import Simulation

    cfg = configs()["example ddp"]
    return cfg, Simulation(cfg).run()


def test_a_run_twice_gives_the_same_fingerprint(ddp):
    cfg, _ = ddp
    a, b = fingerprint(cfg), fingerprint(cfg)
    assert a == b and _same(a, b) is None
    assert set(a) >= {"iteration_time", "timeline_sha256", "work_sha256", "memory_sha256"}


def test_the_outputs_hash_sees_the_bytes_moved_a_counter_a_link_and_a_transfer(ddp):
    _, r = ddp
    before = _outputs_sha256(r)
    for change in ("bytes", "counter", "link", "transfer"):
        s = copy.copy(r)
        if change == "bytes":  # the summary's bytes moved, by one byte
            s.bytes_delivered = r.bytes_delivered + 1.0
        elif change == "counter":
            s.network_stats = {**r.network_stats, "reallocations": -1}
        elif change == "link":
            links = r.per_link().copy()
            links.iloc[0, -1] = links.iloc[0, -1] + 1e-9
            s.per_link = lambda links=links: links
        else:
            tr = r.transfers().copy()
            tr.loc[tr.index[0], "end"] = tr["end"].iloc[0] * (1 + 1e-15)
            s.transfers = lambda tr=tr: tr
        assert _outputs_sha256(s) != before, change
    assert _outputs_sha256(r) == before


def test_outputs_that_differ_are_named_and_an_older_file_is_compared_on_the_rest():
    a = {"iteration_time": "1.0", "work_sha256": "w", "memory_sha256": "m", "outputs_sha256": "x"}
    b = {**a, "outputs_sha256": "y"}
    assert _same(a, b) == "outputs differ (summary, network counters, links or transfers)"
    older = {k: v for k, v in a.items() if k != "outputs_sha256"}
    assert _same(older, b) is None
