"""One config schema: every part's options checked before a run, with clear messages."""

import pickle

import pytest

from networks import topology as topo
from tests.conftest import chain_trace
from triosim.common import schema
from triosim.common.errors import ConfigError
from triosim.common.registry import Registry
from triosim.common.units import parse_bandwidth, parse_bytes, parse_seconds
from triosim.config.loading import from_dict
from triosim.simulation.wiring import Simulation

BASE = {"trace": "x.trace.json.gz", "num_gpus": 4}


def refused(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict({**BASE, **data})


# -- unknown, misplaced, mistyped and impossible fields ----------------------------------------


def test_a_typo_gets_a_did_you_mean():
    refused({"topology": {"bandwith": "10 GB/s"}}, r"topology.bandwith.*did you mean 'bandwidth'")
    refused({"num_gpu": 4}, r"'num_gpu'.*did you mean 'num_gpus'")
    refused({"network": {"kind": "photonic", "setuptime": "1 ms"}}, "did you mean 'setup_time'")


def test_a_field_of_another_mode_names_its_owner():
    # microbatches is a pipeline field: under ddp it would be silently ignored
    refused(
        {"parallelism": {"mode": "ddp", "microbatches": 4}},
        "parallelism.microbatches.*a field of parallelism mode '1f1b' or '3d' or 'gpipe' or "
        "'interleaved' or 'mesh', not of "
        "parallelism mode 'ddp'",
    )
    refused({"topology": {"kind": "ring", "rows": 2}}, r"topology.rows.*'mesh2d'")
    refused({"network": {"routing": "hops", "kind": "photonic"}}, r"network.routing.*'packet'")
    refused({"mode": "dp"}, r"'mode'.*section 'parallelism'")


@pytest.mark.parametrize(
    "data,match",
    [
        ({"num_gpus": "two"}, r"'num_gpus' = 'two'.*an integer >= 1"),
        ({"num_gpus": 0}, r"num_gpus.*>= 1"),
        ({"batch_size": -8}, r"batch_size.*> 0"),
        ({"seed": True}, "seed"),
        ({"parallelism": {"mode": "gpipe", "microbatches": 2.5}}, "microbatches.*integer"),
        ({"parallelism": {"mode": "ddp", "bucket_size": 0}}, r"bucket_size.*> 0"),
        ({"parallelism": {"mode": "ddp", "bucket_size": "25 MB/s"}}, "bucket_size.*is a bandwidth"),
        ({"network": {"kind": "photonic", "links": "8"}}, "network.links.*integer"),
        ({"network": {"kind": "photonic", "setup_time": "-1 ms"}}, r"setup_time.*>= 0"),
        ({"network": {"kind": "photonic", "buffer_bytes": 0}}, r"buffer_bytes.*> 0"),
        ({"network": {"kind": "packet", "routing": "shortest"}}, "routing.*latency, hops"),
        ({"network": {"kind": "warp"}}, r"network.kind.*one of packet, photonic"),
        ({"topology": {"kind": "mesh2d", "rows": 0}}, r"topology.rows.*>= 1"),
        (
            {"topology": {"kind": "pcie_tree", "host_bandwidth": "16 GB"}},
            "host_bandwidth.*is a size",
        ),
        ({"topology": {"latency": "1 MS"}}, "case-sensitive.*'ms'"),
        ({"perfmodel": {"kind": "regression", "holdout": 1.5}}, r"holdout.*< 1"),
        ({"perfmodel": {"kind": "regression", "extra_traces": "a.json"}}, "extra_traces.*a list"),
        (
            {"parallelism": {"mode": "hybrid", "dp": 2, "inner": "ddp"}},
            r"parallelism.inner.*a mode that hybrid replicates: .*gpipe",
        ),
        (
            {"parallelism": {"mode": "hybrid", "inner": "gpipe", "bucket_size": "1 MB"}},
            r"bucket_size.*mode .*'ddp'",
        ),
        ({"gpu": "Z9000"}, r"'gpu' = 'Z9000'.*one of A40, A100-40GB"),
        (
            {"communication": {"kind": "textbook", "algorithm": "butterfly"}},
            "communication.algorithm.*one of ring",
        ),
        ({"communication": {"kind": "telepathy"}}, "communication.kind.*one of"),
        (
            {"topology": {"links": [{"src": 0, "dst": 1, "bandwidht": 1}]}},
            r"topology.links\[0\].bandwidht.*did you mean 'bandwidth'",
        ),
        ({"parallelism": "ddp"}, "'parallelism' = 'ddp'.*a mapping"),
    ],
)
def test_bad_values_are_refused_at_load(data, match):
    refused(data, match)


def test_hybrid_takes_its_inner_modes_fields():
    cfg = from_dict(
        {**BASE, "parallelism": {"mode": "hybrid", "dp": 2, "inner": "gpipe", "microbatches": 4}}
    )
    assert cfg.parallelism.options.inner_options.microbatches == 4
    again = from_dict({**cfg.to_dict(), "trace": "x.trace.json.gz"})
    assert again.parallelism.options == cfg.parallelism.options


# -- units -----------------------------------------------------------------------------------


def test_units_mean_what_they_say():
    assert parse_bandwidth("65 GB/s") == 65e9  # bytes
    assert parse_bandwidth("400 Gb/s") == 50e9  # bits: 400e9 / 8
    assert parse_bandwidth("1 KiB/s") == 1024
    assert parse_bytes("25 MiB") == 25 * 2**20 and parse_bytes("1.5 GB") == 1.5e9
    assert parse_seconds("20 ms") == pytest.approx(0.02) and parse_seconds("2 us") == 2e-6
    for bad, kind in (
        ("65 gb/s", "bandwidth"),
        ("65 GB", "bandwidth"),
        ("25 Mb", "bytes"),
        ("1 MS", "seconds"),
        ("100 Gbps", "bandwidth"),
        ("3 bogus", "bytes"),
    ):
        with pytest.raises(ConfigError):
            {"bandwidth": parse_bandwidth, "bytes": parse_bytes, "seconds": parse_seconds}[kind](
                bad
            )


def test_every_bandwidth_field_takes_units():
    cfg = from_dict(
        {
            **BASE,
            "topology": {"kind": "pcie_tree", "host_bandwidth": "16 GB/s", "bandwidth": "256 Gb/s"},
            "parallelism": {"mode": "dp"},
        }
    )
    g = Simulation(cfg, trace=chain_trace(batch=8)).graph  # (builds, then the mode check)
    assert (
        g.edges["pcie0", "root"]["bandwidth"] == 16e9 and g.edges[0, "pcie0"]["bandwidth"] == 32e9
    )


# -- checks that need the trace or the topology: still before the run --------------------------


def sim(trace=None, **cfg):
    cfg.setdefault("parallelism", {"mode": "dp"})
    return Simulation({"num_gpus": 4, **cfg}, trace=trace or chain_trace(batch=8))


def test_a_link_override_must_name_an_existing_link():
    with pytest.raises(ConfigError, match=r"topology.links\[0\].*no link 0->2"):
        sim(topology={"kind": "ring", "links": [{"src": 0, "dst": 2, "bandwidth": 1e9}]})
    with pytest.raises(ConfigError, match=r"topology.links\[0\].*a bandwidth and/or a latency"):
        sim(topology={"kind": "ring", "links": [{"src": 0, "dst": 1}]})
    s = sim(topology={"kind": "ring", "links": [{"src": 0, "dst": 1, "bandwidth": "1 GB/s"}]})
    assert s.graph.edges[0, 1]["bandwidth"] == 1e9 and s.graph.edges[1, 0]["bandwidth"] == 65e9


def test_tp_degree_must_divide_the_split_layers():
    # chain_trace's linear weights are 64 x 16: 64 output units split 4 ways, not 3 or 6
    sim(parallelism={"mode": "tp"})
    with pytest.raises(ConfigError, match="num_gpus.*dividing layer layer0's 64 output units"):
        Simulation({"num_gpus": 3, "parallelism": {"mode": "tp"}}, trace=chain_trace(batch=8))


def test_the_traced_gpu_must_be_known_to_retarget():
    t = chain_trace(batch=8)
    del t.metadata["gpu"]
    with pytest.raises(ConfigError, match="does not say which GPU.*--gpu"):
        sim(t, gpu="A100", parallelism={"mode": "dp"})
    t.metadata["gpu"] = "Tesla K80"
    with pytest.raises(ConfigError, match="source_gpu.*'Tesla K80'.*catalogue"):
        sim(t, gpu="A100", perfmodel={"kind": "roofline"})
    with pytest.raises(ConfigError, match=r"traced GPU \(H100-SXM\).*roofline"):
        sim(gpu="A40")  # the regression model stays on the traced GPU


def test_problems_surface_at_construction_not_mid_run():
    # every one of these used to pass construction and fail (or not) inside env.run()
    with pytest.raises(ConfigError, match="setup_time"):
        sim(network={"kind": "photonic", "setup_time": -1})
    with pytest.raises(ConfigError, match="gpu"):
        sim(gpu="A40")


def test_a_photonic_buffer_smaller_than_a_transfer_is_an_error():
    s = sim(parallelism={"mode": "dp"}, network={"kind": "photonic", "buffer_bytes": "1 MB"})
    with pytest.raises(ConfigError, match=r"network.buffer_bytes.*at least the largest transfer"):
        s.run()


# -- registries --------------------------------------------------------------------------------


def test_registering_a_taken_name_is_an_error_unless_replacing():
    reg = Registry("thing.kind", "kind", "thing")

    class A:
        pass

    class B:
        pass

    reg.register("a", A)
    with pytest.raises(ConfigError, match="not yet registered.*replace=True"):
        reg.register("a", B)
    assert reg.get("a") is A
    reg.register("a", B, replace=True)
    assert reg.get("a") is B and B.kind == "a"
    with pytest.raises(ConfigError, match="one of a"):
        reg.get("b")


def test_builtin_names_cannot_be_taken_by_accident():
    from networks import PacketSwitchNetwork, register

    class Mine(PacketSwitchNetwork):
        pass

    with pytest.raises(ConfigError, match="network.kind.*'packet'"):
        register("packet")(Mine)
    assert topo.TOPOLOGIES.get("ring") is not None


# -- results and saved configs ------------------------------------------------------------------


def test_result_is_a_plain_picklable_record():
    r = sim(parallelism={"mode": "ddp"}).run()
    back = pickle.loads(pickle.dumps(r))
    assert back.iteration_time == r.iteration_time and back.timeline.equals(r.timeline)
    assert not hasattr(r, "network") and not hasattr(r, "extrapolator")
    assert list(back.per_link().columns) == [
        "src",
        "dst",
        "bandwidth",
        "latency",
        "nbytes",
        "busy_time",
        "utilisation",
    ]


def test_link_stats_have_one_column_set_for_every_network():
    packet = sim(parallelism={"mode": "dp"}).run().per_link()
    photonic = sim(parallelism={"mode": "dp"}, network={"kind": "photonic"}).run().per_link()
    assert list(packet.columns) == list(photonic.columns)
    assert (photonic["nbytes"] > 0).all() and photonic["busy_time"].le(
        photonic["utilisation"] * 1e9
    ).all()


def test_saved_config_reruns_as_it_stands(tmp_path):
    from triosim.trace.model import save

    trace_dir = tmp_path / "traces"
    save(chain_trace(batch=8), trace_dir / "c.trace.json.gz")
    cfg_dir = tmp_path / "configs"
    cfg_dir.mkdir()
    (cfg_dir / "run.yaml").write_text(
        "trace: ../traces/c.trace.json.gz\nnum_gpus: 4\n"
        "parallelism: {mode: ddp, bucket_size: 2 MB}\n"
        "network: {kind: packet, routing: hops}\n"
    )
    r = Simulation(cfg_dir / "run.yaml").run()
    out = tmp_path / "elsewhere" / "deeper"
    r.save(out)
    again = Simulation(out / "config.yaml").run()  # the trace path was rebased
    assert again.iteration_time == r.iteration_time
    assert again.config.parallelism.options.bucket_size == 2e6
    assert again.config.network.options.routing == "hops"


def test_a_python_topology_and_trace_are_recorded(tmp_path):
    t = chain_trace(batch=8)
    g = topo.dgx1(25e9, 1e-6)
    topo.set_link(g, 0, 1, bandwidth=5e9)
    r = Simulation({"num_gpus": 8, "parallelism": {"mode": "dp"}}, trace=t, topology=g).run()
    r.save(tmp_path / "out")
    again = Simulation(tmp_path / "out" / "config.yaml").run()
    assert again.config.topology.kind == "edges"
    assert again.iteration_time == pytest.approx(r.iteration_time, rel=1e-12)
    # the default ring at 65 GB/s would be faster than this slow-linked cube-mesh
    default = Simulation({"num_gpus": 8, "parallelism": {"mode": "dp"}}, trace=t).run()
    assert default.iteration_time < r.iteration_time


def test_schema_describes_every_field():
    from triosim.config.loading import fields_help

    text = fields_help()
    for name in (
        "bucket_size",
        "microbatches",
        "setup_time",
        "routing",
        "radix",
        "rows",
        "inter_bandwidth",
        "extra_traces",
        "source_gpu",
        "host_bandwidth",
    ):
        assert f"\n      {name}" in text, name
    rows = dict((n, w) for n, w, _ in schema.describe(topo.PcieOptions))
    assert rows["host_bandwidth"].startswith("a bandwidth in bytes/s > 0")


def test_simulate_help_lists_the_schema(capsys):
    from triosim.cli.main import main

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "with mode: ddp" in out and "bucket_size" in out and "default 25 MiB" in out
    assert "with kind: photonic" in out and "default 20 ms" in out
