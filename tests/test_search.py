"""triosim search: candidates, memory filter, ranking equal to separate runs."""

import pytest

from tests.conftest import chain_trace
from triosim.simulation.wiring import Simulation
from triosim.studies.search import candidates, search
from triosim.trace.model import save


@pytest.fixture
def base(tmp_path):
    path = save(chain_trace(batch=8, layers=4), tmp_path / "c.trace.json.gz")
    return {
        "trace": str(path),
        "num_gpus": 4,
        "batch_size": 16,
        "topology": {"kind": "ring", "bandwidth": "10 GB/s", "latency": "1 us"},
    }


def test_candidates_cover_every_family():
    labels = [label for label, _ in candidates(4, 16)]
    for want in (
        "dp",
        "ddp",
        "fsdp zero-3",
        "tp 4",
        "gpipe 4 stages x 8 mb",
        "dp 2 x tp 2",
        "dp 2 x 1f1b 2 stages x 4 mb",
    ):
        assert want in labels


def test_the_best_is_the_fastest_of_the_separate_runs(base):
    ranked, table, best = search(base, progress=False)
    assert len(ranked) >= 10 and (ranked["status"] == "ok").all()
    times = []
    for _label, par in candidates(4, 16):
        try:
            times.append(Simulation({**base, "parallelism": par}).run().iteration_time)
        except Exception:  # noqa: BLE001 - a plan the trace does not allow
            continue
    assert ranked.loc[0, "iteration_time_ms"] == pytest.approx(min(times) * 1e3, rel=1e-12)
    assert Simulation(best).run().iteration_time == pytest.approx(min(times), rel=1e-12)


def test_the_search_never_returns_a_plan_that_does_not_fit(base):
    # 16 MB of fp32 weights, no optimizer states: DP holds 32 MB (weights + gradients) per
    # GPU, ZeRO-3 a quarter. With 20 MB usable, replicated plans must drop out.
    tight = {**base, "memory": {"capacity": "21 MB", "reserve": "1 MB"}}
    ranked, table, _ = search(tight, progress=False)
    assert len(ranked) and "dp" not in set(ranked["plan"]) and "ddp" not in set(ranked["plan"])
    assert (ranked["peak_memory_gb_max"] * 1e9 <= 20e6).all()
    assert table["status"].str.startswith("out of memory").sum() >= 2
