"""GPUs a config defines (`gpus:`, triosim/hardware/custom.py): a catalogue GPU and its
differences, found by every part that looks a GPU up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from triosim.common.errors import ConfigError
from triosim.config.loading import from_dict
from triosim.hardware import catalogue
from triosim.simulation.wiring import Simulation

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "traces" / "h100" / "resnet50-b128.trace.json.gz")
AS_H200 = {"name": "my-h200", "base": "H100-SXM", "memory_capacity": "141 GB",
           "memory_bandwidth": "4.8 TB/s"}  # fmt: skip


def figures(g):
    d = dataclasses.asdict(g)
    return {k: v for k, v in d.items() if k not in ("name", "aliases")}


def test_an_h100_with_the_h200s_memory_is_the_catalogues_h200():
    # the H200 is the H100 SXM's chip with 141 GB of HBM3e at 4.8 TB/s (the catalogue's
    # sources): defined so, it equals the catalogue's entry in every figure
    from_dict({"trace": TRACE, "gpu": "my-h200", "gpus": [AS_H200]})
    assert figures(catalogue.gpu("my-h200")) == figures(catalogue.gpu("H200"))
    runs = {}
    for gpu, gpus in (("H200", []), ("my-h200", [AS_H200])):
        cfg = {
            "trace": TRACE,
            "num_gpus": 1,
            "gpu": gpu,
            "gpus": gpus,
            "perfmodel": {"kind": "roofline"},
        }
        r = Simulation(cfg).run()
        runs[gpu] = (r.iteration_time, r.peak_memory[0])
    assert runs["my-h200"] == runs["H200"]


def test_a_lower_clock_scales_every_peak():
    # H100 SXM at 990 MHz, half its 1,980: every tensor and vector peak halves; a peak
    # given is taken as it is
    spec = {"name": "slow-h100", "base": "H100-SXM", "boost_clock_mhz": 990,
            "peak_tflops": {"float8": 1000}}  # fmt: skip
    from_dict({"trace": TRACE, "gpus": [spec]})
    g, base = catalogue.gpu("slow-h100"), catalogue.gpu("H100-SXM")
    assert g.peak_flops["bfloat16"] == pytest.approx(989.4e12 / 2)
    assert g.vector_flops["float32"] == pytest.approx(base.vector_flops["float32"] / 2)
    assert g.peak_flops["float8"] == 1000e12
    assert (g.memory_capacity, g.memory_bandwidth) == (base.memory_capacity, 3350e9)


def test_a_defined_gpu_is_saved_with_the_config_and_reruns(tmp_path):
    cfg = from_dict({"trace": TRACE, "gpu": "my-h200", "gpus": [AS_H200]}, base_dir=".")
    again = from_dict(cfg.to_dict())
    assert again.gpus == cfg.gpus and again.gpu == "my-h200"


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"name": "x", "base": "H900"}, "gpus[0].base"),
        ({"name": "H100", "base": "H100-SXM"}, "gpus[0].name"),  # a shipped GPU's alias
        ({"base": "H100-SXM"}, "gpus[0].name"),
        ({"name": "x", "base": "H100-SXM", "peak_tflops": {"fp8": 100}}, "gpus[0].peak_tflops.fp8"),
        ({"name": "x", "base": "H100-SXM", "memory_capacity": "80"}, None),  # a warning only
        ({"name": "x", "base": "H100-SXM", "memory_bandwidth": "3 TB"}, "gpus[0].memory_bandwidth"),
        ({"name": "x", "base": "H100-NVL", "boost_clock_mhz": 1500}, "gpus[0].boost_clock_mhz"),
    ],
)
def test_a_wrong_definition_is_refused_naming_its_field(spec, field):
    if field is None:
        with pytest.warns(UserWarning, match="memory_capacity"):
            from_dict({"trace": TRACE, "gpus": [spec]})
        return
    with pytest.raises(ConfigError) as e:
        from_dict({"trace": TRACE, "gpus": [spec]})
    assert e.value.field == field


def test_two_definitions_of_one_name_are_refused():
    with pytest.raises(ConfigError, match="gpus\\[1\\].name"):
        from_dict({"trace": TRACE, "gpus": [AS_H200, AS_H200]})


def test_a_gpu_defined_again_under_its_name_is_the_one_looked_up():
    # the lookup keeps what it found (once per operator it was a tenth of a large run's
    # set-up), but a config that defines the name again, differently, gets its own figures
    slow = {"name": "twice-h100", "base": "H100-SXM", "boost_clock_mhz": 990}
    from_dict({"trace": TRACE, "gpus": [slow]})
    first = catalogue.gpu("twice-h100")
    assert catalogue.gpu("TWICE_H100") is first  # (by its normalized name too)
    from_dict({"trace": TRACE, "gpus": [{**slow, "boost_clock_mhz": 1980}]})
    again = catalogue.gpu("twice-h100")
    assert again.peak_flops["bfloat16"] == pytest.approx(2 * first.peak_flops["bfloat16"])
    del catalogue.GPUS["twice-h100"]
    with pytest.raises(ConfigError):
        catalogue.gpu("twice-h100")
