"""The config's edges: every numeric field refuses what no run can use (NaN, infinity, numbers
too large for a float), warns on what no real system has (a bare `bandwidth: 65` is 65 B/s),
and no input is silently ignored (duplicate YAML keys, a link overridden twice)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triosim.common import schema, units
from triosim.common.errors import ConfigError
from triosim.config.loading import TopLevel, _sections, from_dict

BASE = {"trace": "x.trace.json.gz", "num_gpus": 4}


# -- every numeric field of the schema -------------------------------------------------------


def _numeric(tp) -> str | None:
    """'float', 'int' or None: what kind of number a field's type takes."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        kinds = {_numeric(a) for a in args} - {None}
        return "float" if "float" in kinds else ("int" if kinds else None)
    if origin is dict:
        return _numeric(args[1])
    if origin is list:
        return _numeric(args[0]) if args else None
    return {float: "float", int: "int"}.get(tp)


def _required(cls) -> dict:
    """Values for the fields `cls` requires (src/dst of a link, a factor)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for k, f in enumerate(dataclasses.fields(cls)):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            tp = hints[f.name]
            out[f.name] = "x" if tp is str else 2.0 if _numeric(tp) == "float" else k
    return out


def _wrap(tp, value):
    """`value` placed where the type wants it: a dict's value, a list's item."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if typing.get_origin(a) in (dict, list)]
        return _wrap(inner[0], value) if inner and not _numeric_scalar(tp) else value
    if origin is dict:
        return {0: value}
    if origin is list:
        return [value]
    return value


def _numeric_scalar(tp) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


def _options_classes():
    """(class, where) for every options dataclass a config reaches, nested ones included."""
    seen, out = set(), []

    def visit(cls, where):
        if cls in seen or not dataclasses.is_dataclass(cls):
            return
        seen.add(cls)
        out.append((cls, where))
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            for inner in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(inner):
                    visit(inner, f"{where}.{f.name}")

    visit(TopLevel, "")
    from networks.topology import LinkSpec

    visit(LinkSpec, "topology.links[0]")
    for name, (cls, _, registry) in _sections().items():
        visit(cls, name)
        for kind, part in registry.items():
            visit(getattr(part, "Options", schema.NoOptions), f"{name} ({kind})")
    return out


NUMERIC = [
    pytest.param(cls, f.name, id=f"{where or 'top'}.{f.name}")
    for cls, where in _options_classes()
    for f in dataclasses.fields(cls)
    if f.init and not f.metadata.get("flatten") and _numeric(typing.get_type_hints(cls)[f.name])
]


def test_the_walk_finds_the_numeric_fields_of_every_part():
    names = {p.id.rsplit(".", 1)[1] for p in NUMERIC}
    # a sample from every kind of place: top level, sections, parts, nested lists and dicts
    assert {
        "num_gpus",
        "batch_size",
        "bandwidth",
        "latency",
        "inter_bandwidth",
        "setup_time",
        "buffer_bytes",
        "bucket_size",
        "factor",
        "low",
        "compute",
        "reserve",
        "capacity",
        "holdout",
        "latency_scale",
        "launch_overhead",
        "microbatches",
    } <= names
    assert len(NUMERIC) >= 40


def _bad_numbers(cls, name):
    """Spellings of NaN, +-infinity and an overflowing number that this field could be given."""
    md = next(f for f in dataclasses.fields(cls) if f.name == name).metadata
    plain = st.sampled_from([math.inf, -math.inf, math.nan, 10**400, -(10**400)])
    if not md.get("unit"):
        return plain
    spelled = st.tuples(
        st.sampled_from(["inf", "-inf", "+inf", "1e400", "-1e999"]),
        st.sampled_from(sorted(units.KINDS[md["unit"]][0])),
    )
    return plain | spelled.map(lambda t: f"{t[0]} {t[1]}".strip())


@pytest.mark.parametrize("cls,name", NUMERIC)
def test_no_numeric_field_takes_nan_or_infinity_unless_it_says_what_it_means(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    tp = typing.get_type_hints(cls)[name]

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(bad=_bad_numbers(cls, name))
    def check(bad):
        data = {**_required(cls), name: _wrap(tp, bad)}
        x = units.parse(bad, f.metadata["unit"], name) if isinstance(bad, str) else bad
        if f.metadata.get("inf") and units.to_float(x) == math.inf:
            assert getattr(schema.load(cls, data, "sec"), name) == math.inf  # documented
            assert f"inf: {f.metadata['inf']}" in schema.describe_type(tp, f.metadata)
            return
        with pytest.raises(ConfigError) as e:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (a value that loads would warn first)
                schema.load(cls, data, "sec")
        assert e.value.field.startswith(f"sec.{name}"), e.value.message

    check()


def test_inf_is_taken_only_where_documented():
    documented = sorted({p.id for p in NUMERIC if _field(p).metadata.get("inf")})
    assert documented == ["network (photonic).buffer_bytes"]  # its default: no buffer limit


def _field(p):
    cls, name = p.values
    return next(f for f in dataclasses.fields(cls) if f.name == name)


@pytest.mark.parametrize(
    "data,field",
    [
        ({"topology": {"bandwidth": "inf GB/s"}}, "topology.bandwidth"),
        ({"topology": {"bandwidth": math.inf}}, "topology.bandwidth"),
        ({"topology": {"latency": math.nan}}, "topology.latency"),
        ({"batch_size": math.inf}, "batch_size"),
        (
            {
                "topology": {
                    "kind": "multi_node",
                    "gpus_per_node": 2,
                    "inter_bandwidth": "1e400 GB/s",
                }
            },
            "topology.inter_bandwidth",
        ),
        (
            {"topology": {"links": [{"src": 0, "dst": 1, "bandwidth": "inf Gb/s"}]}},
            "topology.links[0].bandwidth",
        ),
        (
            {"topology": {"kind": "edges", "edges": [{"src": 0, "dst": 1, "bandwidth": math.inf}]}},
            "topology.edges[0].bandwidth",
        ),
        (
            {"communication": {"kind": "nccl", "bandwidth_scale": math.inf}},
            "communication.bandwidth_scale",
        ),
        ({"heterogeneity": {"compute": {1: math.inf}}}, "heterogeneity.compute[1]"),
        ({"memory": {"capacity": "inf GB"}}, "memory.capacity"),
        ({"parallelism": {"mode": "ddp", "bucket_size": 10**400}}, "parallelism.bucket_size"),
        ({"num_gpus": 10**30}, "num_gpus"),
    ],
)
def test_a_whole_config_names_the_non_finite_field(data, field):
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, **data})
    assert e.value.field == field
    allowed = e.value.allowed
    assert "finite" in allowed or "below 2**63" in allowed or allowed == "an integer > 0", allowed


def test_a_huge_value_is_shown_short():
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "topology": {"bandwidth": 10**400}})
    assert len(str(e.value)) < 400 and "(401 characters)" in str(e.value)


def test_a_python_topology_with_an_infinite_link_is_refused_before_the_run():
    from networks import topology as topo
    from tests.conftest import chain_trace
    from triosim.common.errors import NetworkError
    from triosim.simulation.wiring import Simulation

    g = topo.ring(4, 65e9, 1e-6)
    for u, v in g.edges:
        g.edges[u, v]["bandwidth"] = math.inf  # crashed inside SimPy: OverflowError
    with pytest.raises(NetworkError, match=r"link 0->1: bandwidth must be a finite number"):
        Simulation(
            {"num_gpus": 4, "parallelism": {"mode": "ddp"}}, trace=chain_trace(batch=8), topology=g
        )


# -- values far from any real one: a warning that says what was probably meant ----------------

UNITS = [p for p in NUMERIC if _field(p).metadata.get("plausible")]


def _loaded_warnings(cls, data) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schema.load(cls, {**_required(cls), **data}, "sec")
    return [str(w.message) for w in caught if w.category is units.ImplausibleValueWarning]


def test_every_field_with_a_unit_is_checked_for_plausibility():
    names = {p.id.rsplit(".", 1)[1] for p in UNITS}
    assert {
        "bandwidth",
        "latency",
        "inter_bandwidth",
        "setup_time",
        "buffer_bytes",
        "bucket_size",
        "first_bucket_size",
        "reserve",
        "capacity",
        "launch_overhead",
        "pipeline_overhead",
        "total_bandwidth",
        "host_bandwidth",
        "factor",
        "compute",
        "low",
        "high",
    } <= names
    for p in NUMERIC:
        if _field(p).metadata.get("unit"):
            assert p in UNITS, p.id
    assert {_field(p).metadata["plausible"] for p in UNITS} <= set(units.PLAUSIBLE)


@pytest.mark.parametrize("cls,name", UNITS)
def test_a_value_far_from_any_real_one_warns_and_a_real_one_does_not(cls, name):
    f = _field(pytest.param(cls, name))
    tp = typing.get_type_hints(cls)[name]
    lo, hi, typical, _ = units.PLAUSIBLE[f.metadata["plausible"]]
    default = f.default if isinstance(f.default, float) and math.isfinite(f.default) else None
    for real in (typical, default):  # the defaults are real values: the table must hold them
        if real:
            assert _loaded_warnings(cls, {name: _wrap(tp, real)}) == [], (real, name)
    floor = next((f.metadata[k] for k in ("ge", "gt") if f.metadata.get(k) is not None), None)
    for far in (lo / 1e4, hi * 1e4):
        if floor is not None and far < floor:
            continue  # below the field's own bound: an error, not a warning (a ratio >= 1)
        (msg,) = _loaded_warnings(cls, {name: _wrap(tp, far)})
        assert msg.startswith(f"sec.{name}") and f"{far:g}" in msg and "far " in msg
        if f.metadata.get("unit"):  # the unit it was read in
            assert (
                "read as" in msg
                and {"bandwidth": "B/s", "seconds": " s", "bytes": " B"}[f.metadata["unit"]] in msg
            )


@pytest.mark.parametrize(
    "data,meant",
    [
        (
            {"topology": {"bandwidth": 65}},
            "topology.bandwidth = 65 read as 65 B/s; did you mean 65 GB/s?",
        ),
        ({"topology": {"latency": 1}}, "topology.latency = 1 read as 1 s; did you mean 1 us?"),
        (
            {"topology": {"links": [{"src": 0, "dst": 1, "latency": 2}]}},
            "topology.links[0].latency = 2 read as 2 s; did you mean 2 us?",
        ),
        (
            {"parallelism": {"mode": "ddp", "bucket_size": 25}},
            "parallelism.bucket_size = 25 read as 25 B; did you mean 25 MiB?",
        ),
        (
            {"network": {"kind": "photonic", "setup_time": 20}},
            "network.setup_time = 20 read as 20 s; did you mean 20 ms?",
        ),
        ({"memory": {"capacity": 80}}, "memory.capacity = 80 read as 80 B; did you mean 80 GB?"),
        (
            {"topology": {"kind": "multi_node", "gpus_per_node": 2, "inter_bandwidth": 400}},
            "topology.inter_bandwidth = 400 read as 400 B/s; did you mean 400 GB/s?",
        ),
        (
            {"communication": {"kind": "nccl", "launch_overhead": 5}},
            "communication.launch_overhead = 5 read as 5 s; did you mean 5 us?",
        ),
        (
            {"topology": {"bandwidth": "65 B/s"}},
            "topology.bandwidth = '65 B/s' is 65 B/s (far below",
        ),
        ({"heterogeneity": {"compute": {1: 1e6}}}, "heterogeneity.compute[1] = 1e+06 (far above"),
    ],
)
def test_the_warning_says_what_was_probably_meant(data, meant):
    with pytest.warns(units.ImplausibleValueWarning) as caught:
        from_dict({**BASE, **data})
    assert [str(w.message)[: len(meant)] for w in caught] == [meant]


def test_real_configs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_dict(
            {
                **BASE,
                "topology": {
                    "bandwidth": "400 Gb/s",
                    "latency": "2 us",
                    "links": [{"src": 0, "dst": 1, "bandwidth": 25e9}],
                },
                "parallelism": {"mode": "ddp", "bucket_size": "25 MiB"},
                "memory": {"reserve": 0, "capacity": "80 GB"},
                "heterogeneity": {"compute": {1: 2.0}},
            }
        )


def test_the_catalogue_lies_within_the_plausible_ranges():
    from triosim.hardware import catalogue as hardware

    def inside(x, kind):
        lo, hi, _, _ = units.PLAUSIBLE[kind]
        return lo <= x <= hi

    for g in hardware.GPUS.values():
        assert all(inside(f, "flops") for f in g.peak_flops.values()), g.name
        assert inside(g.memory_bandwidth, "bandwidth") and inside(g.memory_capacity, "bytes")
    for link in hardware.LINKS.values():
        assert inside(link.bandwidth, "bandwidth") and (
            link.latency == 0 or inside(link.latency, "seconds")
        )


def test_the_command_line_prints_the_warning_for_a_file_and_for_set(capsys, tmp_path):
    from tests.conftest import run_cli

    trace = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        f"trace: {trace}\nnum_gpus: 1\nparallelism: {{mode: single}}\n"
        "perfmodel: {kind: trace}\ntopology: {bandwidth: 65}\n"
    )
    code, out, err = run_cli(capsys, "simulate", cfg, "--no-save", "--set", "topology.latency=1")
    assert code == 0, err
    lines = [x for x in err.splitlines() if x.startswith("warning: topology.")]
    assert [x.split("?")[0] for x in lines] == [
        "warning: topology.bandwidth = 65 read as 65 B/s; did you mean 65 GB/s",
        "warning: topology.latency = 1 read as 1 s; did you mean 1 us",
    ]


# -- nothing silently ignored: a key given twice, a link set twice -----------------------------

TRACE = Path(__file__).resolve().parents[1] / "traces" / "cpu" / "gpt2-small-b8.trace.json.gz"


def _one_error(capsys, *args) -> str:
    from tests.conftest import run_cli

    code, out, err = run_cli(capsys, *args)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def test_a_key_given_twice_in_a_config_file_names_the_key_and_lines(capsys, tmp_path):
    cfg = tmp_path / "twice.yaml"
    cfg.write_text(
        f"trace: {TRACE}\nnum_gpus: 1\ntopology:\n  bandwidth: 65 GB/s\n"
        "  latency: 1 us\n  bandwidth: 10 GB/s\n"
    )
    msg = _one_error(capsys, "simulate", cfg, "--no-save")
    assert msg == (
        f"error: config file {cfg}, line 6, column 3: not valid YAML: key "
        "'bandwidth' is given twice in one mapping (lines 4 and 6); only the last "
        "would count: keep one"
    )


def test_a_key_given_twice_in_a_grid_file_or_a_set_value(capsys, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        f"base: {{trace: {TRACE}, num_gpus: 1}}\ngrid:\n  num_gpus: [1, 2]\n  num_gpus: [4]\n"
    )
    msg = _one_error(capsys, "sweep", grid, "--out", tmp_path / "out")
    assert "line 4, column 3" in msg and "key 'num_gpus' is given twice" in msg
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(f"trace: {TRACE}\nnum_gpus: 1\n")
    msg = _one_error(capsys, "simulate", cfg, "--set", "topology={latency: 0, latency: 1 us}")
    assert msg.startswith("error: --set 'topology={latency: 0, latency: 1 us}', line 1")
    assert "key 'latency' is given twice in one mapping (line 1, columns 2 and 14)" in msg
    msg = _one_error(capsys, "collectives", cfg, "--set", "topology={kind: ring, kind: switch}")
    assert "key 'kind' is given twice" in msg


def test_yaml_spellings_of_one_key_and_merge_keys():
    from triosim.common.errors import InputError
    from triosim.config.loading import parse_yaml

    with pytest.raises(InputError, match=r"keys 'on' and 'true' are the same key \(True\)"):
        parse_yaml("heterogeneity:\n  on: 1\n  true: 2\n", "f")
    with pytest.raises(InputError, match=r"key 3 is given twice.*lines 1 and 2"):
        parse_yaml("3: a\n3: b\n", "f")
    # a merge key (<<) is meant to be overridden: still allowed
    assert parse_yaml("a: &x {k: 1, m: 2}\nb:\n  <<: *x\n  k: 3\n", "f")["b"] == {"k": 3, "m": 2}


@pytest.mark.parametrize(
    "data,where,first",
    [
        (
            {
                "topology": {
                    "links": [
                        {"src": 0, "dst": 1, "bandwidth": "1 GB/s"},
                        {"src": 0, "dst": 1, "latency": "2 us"},
                    ]
                }
            },
            "topology.links[1]",
            "topology.links[0] already sets 0->1",
        ),
        (
            {
                "topology": {
                    "links": [
                        {"src": 2, "dst": 3, "bandwidth": "1 GB/s"},
                        {"src": 0, "dst": 1, "bandwidth": "1 GB/s"},
                        {"src": 1, "dst": 0, "bandwidth": "2 GB/s", "both": True},
                    ]
                }
            },
            "topology.links[2]",
            "topology.links[1] already sets 0->1",
        ),
        (
            {
                "topology": {
                    "kind": "edges",
                    "edges": [
                        {"src": 0, "dst": 1, "bandwidth": "1 GB/s"},
                        {"src": 1, "dst": 0, "bandwidth": "2 GB/s"},
                    ],
                }
            },
            "topology.edges[1]",
            "topology.edges[0] already sets 1->0",
        ),
        (
            {
                "heterogeneity": {
                    "links": [{"src": 0, "dst": 1, "factor": 2}, {"src": 0, "dst": 1, "factor": 3}]
                }
            },
            "heterogeneity.links[1]",
            "heterogeneity.links[0] already sets 0->1",
        ),
    ],
)
def test_one_link_set_twice_is_refused_naming_both_entries(data, where, first):
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, **data})
    assert e.value.field == where and first in e.value.allowed


def test_each_direction_may_be_set_once():
    cfg = from_dict(
        {
            **BASE,
            "topology": {
                "links": [
                    {"src": 0, "dst": 1, "bandwidth": "1 GB/s"},
                    {"src": 1, "dst": 0, "bandwidth": "2 GB/s"},
                ]
            },
        }
    )
    assert [x.bandwidth for x in cfg.topology.links] == [1e9, 2e9]
    edges = [
        {"src": 0, "dst": 1, "bandwidth": 1e9, "both": False},
        {"src": 1, "dst": 0, "bandwidth": 2e9, "both": False},
    ]
    from_dict({**BASE, "num_gpus": 2, "topology": {"kind": "edges", "edges": edges}})


# -- big inputs: checks first, and long work says so -----------------------------------------


@pytest.mark.no_cover
def test_a_config_error_of_a_huge_run_comes_before_the_topology_is_built(monkeypatch):
    from tests.conftest import chain_trace
    from triosim.simulation import wiring as simulation

    def never(cfg):
        raise AssertionError("the topology was built before the plan was checked")

    monkeypatch.setattr(simulation, "build_topology", never)
    # at a million GPUs the ring took 30 s to build and 22 s to check before this line
    with pytest.raises(ConfigError, match=r"'batch_size' = 8 .*a multiple of 1000000"):
        simulation.Simulation(
            {"num_gpus": 10**6, "batch_size": 8, "parallelism": {"mode": "ddp"}},
            trace=chain_trace(batch=8),
        )
    with pytest.raises(ConfigError, match=r"'num_gpus' = 1000000 .*1 for mode 'single'"):
        simulation.Simulation({"num_gpus": 10**6}, trace=chain_trace(batch=8))


def test_the_early_check_leaves_what_needs_the_topology_to_the_real_plan():
    from networks import topology as topo
    from tests.conftest import chain_trace
    from triosim.simulation.wiring import Simulation

    # hop over the topology's own graph: the stand-in has no topology, the real plan has one
    s = Simulation(
        {"num_gpus": 4, "batch_size": 8, "parallelism": {"mode": "hop"}}, trace=chain_trace(batch=8)
    )
    assert s.extrapolator.options.graph == "topology"
    # a 3D placement naming GPUs that are not 0..N-1
    g = topo.from_edges([{"src": "a", "dst": "b", "bandwidth": 1e9}], gpus=["a", "b"])
    s = Simulation(
        {
            "num_gpus": 2,
            "batch_size": 8,
            "parallelism": {"mode": "3d", "dp": 2, "placement": ["b", "a"]},
        },
        trace=chain_trace(batch=8),
        topology=g,
    )
    assert s.extrapolator.layout.at[0, 0, 0, 0, 0] == "b"


def test_a_big_run_says_so_up_front_after_its_checks(monkeypatch, capsys):
    from tests.conftest import chain_trace
    from triosim.simulation import progress
    from triosim.simulation.wiring import Simulation

    monkeypatch.setattr(progress, "BIG_RUN_GPUS", 4)  # (a real one takes minutes)
    cfg = {"num_gpus": 4, "batch_size": 8, "parallelism": {"mode": "ddp"}}
    Simulation(cfg, trace=chain_trace(batch=8), progress=True)
    assert capsys.readouterr().err.startswith("note: simulating 4 GPUs: this may take minutes")
    Simulation(cfg, trace=chain_trace(batch=8))  # a Python caller who did not ask: quiet
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError):
        Simulation({**cfg, "batch_size": 6}, trace=chain_trace(batch=8), progress=True)
    assert "note:" not in capsys.readouterr().err  # an error is not preceded by "minutes"
    assert progress.big_run_note(3) is None


def test_not_on_a_terminal_progress_is_plain_log_lines():
    import io

    from tests.conftest import chain_trace
    from triosim.simulation.progress import run_with_progress
    from triosim.simulation.wiring import Simulation

    # (long enough to outlast a few 1 ms log intervals on a loaded machine)
    cfg = {"num_gpus": 2, "parallelism": {"mode": "ddp"}}
    sim = Simulation(cfg, trace=chain_trace(layers=400))
    out = io.StringIO()  # not a terminal: no bar, but lines
    r = run_with_progress(sim, file=out, log_every=0.001)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) >= 2
    assert lines[-1].startswith("simulating 2 GPUs: done (0:00:0")
    assert all(x.startswith("simulating 2 GPUs") and x.endswith(")") for x in lines)
    assert any(f"tasks done, {r.total_time * 1e3:.3f} ms simulated" in x for x in lines)
    quick = io.StringIO()
    run_with_progress(sim, file=quick)  # a run shorter than log_every (10 s): nothing
    assert quick.getvalue() == ""


def test_a_plans_error_comes_before_a_large_topology_is_built(monkeypatch):
    """Above EARLY_PLAN_ABOVE GPUs the plan is checked on a stand-in first: a bad batch is
    reported without building the topology; below, the same error after it."""
    from tests.conftest import chain_trace
    from triosim.simulation import wiring as simulation

    built = []
    real = simulation.build_topology
    monkeypatch.setattr(simulation, "build_topology", lambda cfg: built.append(1) or real(cfg))
    bad = {"num_gpus": 4, "batch_size": 6, "parallelism": {"mode": "ddp"}}
    with pytest.raises(ConfigError, match="batch_size"):
        simulation.Simulation(bad, trace=chain_trace(batch=8))
    assert built == [1]
    monkeypatch.setattr(simulation, "EARLY_PLAN_ABOVE", 2)
    with pytest.raises(ConfigError, match="batch_size"):
        simulation.Simulation(bad, trace=chain_trace(batch=8))
    assert built == [1]  # not built this time


def test_the_preparation_names_its_stages(monkeypatch):
    from tests.conftest import chain_trace
    from triosim.simulation import progress
    from triosim.simulation import wiring as simulation

    seen = []

    class Watch(progress.RunProgress):
        def stage(self, what):
            seen.append((self.desc, what))
            super().stage(what)

    monkeypatch.setattr(simulation, "RunProgress", Watch)
    cfg = {"num_gpus": 4, "batch_size": 8, "parallelism": {"mode": "ddp"}}
    simulation.Simulation(cfg, trace=chain_trace(batch=8), progress=True)
    assert {d for d, _ in seen} == {"preparing 4 GPUs"}
    assert [w for _, w in seen][:5] == [  # (a small topology: the plan checked after it)
        "loading the trace",
        "building the performance model",
        "building the topology",
        "ordering the ring",
        "planning the streams",
    ]
    seen.clear()
    monkeypatch.setattr(simulation, "EARLY_PLAN_ABOVE", 2)  # a large one: checked before
    simulation.Simulation(cfg, trace=chain_trace(batch=8), progress=True)
    assert [w for _, w in seen][:6] == [
        "loading the trace",
        "building the performance model",
        "checking the plan",
        "building the topology",
        "ordering the ring",
        "planning the streams",
    ]
    w = progress.RunProgress("preparing 4 GPUs", enabled=False)
    w._t0 = 0
    w.stage("building the topology")
    assert w.line().startswith("preparing 4 GPUs: building the topology (")


def test_one_warning_per_value_however_often_the_config_is_checked(capsys, tmp_path):
    from tests.conftest import run_cli

    cfg = tmp_path / "slow.yaml"
    cfg.write_text(
        f"trace: {TRACE}\nnum_gpus: 1\nparallelism: {{mode: single}}\n"
        "perfmodel: {kind: trace}\nnetwork: {kind: photonic, setup_time: 20}\n"
    )
    code, _, err = run_cli(capsys, "simulate", cfg, "--no-save")  # loaded, then re-checked
    assert code == 0, err
    assert [x[:65] for x in err.splitlines() if "setup_time" in x] == [
        "warning: network.setup_time = 20 read as 20 s; did you mean 20 ms"
    ]
    # a mode's options are checked at load, by the early stand-in plan and by the plan, with
    # Python's own once-per-place filter reset in between (importing scikit-learn does it)
    cfg.write_text(
        f"trace: {TRACE}\nnum_gpus: 2\nbatch_size: 8\nparallelism: {{mode: ddp, bucket_size: 25}}\n"
    )
    code, _, err = run_cli(capsys, "simulate", cfg, "--no-save")
    assert code == 0, err
    assert len([x for x in err.splitlines() if "bucket_size = 25 read as" in x]) == 1, err


def test_numbers_in_exponent_form_are_numbers():
    from triosim.config.loading import parse_yaml

    # YAML 1.1 (PyYAML) reads these as strings, which a float field then refused
    assert parse_yaml("a: 1e9\nb: 1.0e6\nc: -2E-3\nd: 10\ne: 1e\n", "f") == {
        "a": 1e9,
        "b": 1e6,
        "c": -2e-3,
        "d": 10,
        "e": "1e",
    }
    cfg = from_dict({**BASE, **parse_yaml("communication: {bandwidth_scale: 1e-1}", "f")})
    assert cfg.communication.options.bandwidth_scale == 0.1


@pytest.mark.parametrize(
    "data,field,value",
    [
        ({"num_gpus": 1e3}, "num_gpus", 1000),  # `num_gpus: 1e3` in YAML
        ({"batch_size": 8.0}, "batch_size", 8),
        ({"parallelism": {"mode": "gpipe", "microbatches": 4.0}}, "parallelism.microbatches", 4),
    ],
)
def test_a_whole_number_written_as_a_float_is_that_integer(data, field, value):
    cfg = from_dict({**BASE, **data})
    section, _, name = field.rpartition(".")
    got = getattr(getattr(cfg, section).options if section else cfg, name)
    assert got == value and type(got) is int


@pytest.mark.parametrize(
    "data,match",
    [
        ({"batch_size": 2.5}, r"'batch_size' = 2.5 is not allowed: an integer > 0"),  # was: "a
        (
            {"batch_size": 1e-9},
            r"'batch_size' = 1e-09 is not allowed: an integer > 0",
        ),  # multiple of 2"
        (
            {"num_gpus": 1e300},
            r"'num_gpus' = 1e\+300 is not allowed: an integer >= 1, below 2\*\*63",
        ),
        ({"num_gpus": 1.5}, r"'num_gpus' = 1.5 is not allowed: an integer >= 1"),
    ],
)
def test_a_count_must_be_whole(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict({**BASE, **data})


def test_a_config_changed_from_python_after_loading_is_checked_again():
    from tests.conftest import chain_trace
    from triosim.simulation.wiring import Simulation

    cfg = from_dict({**BASE, "trace": "<in memory>", "parallelism": {"mode": "ddp"}})
    cfg.topology.bandwidth = math.inf  # crashed inside SimPy: OverflowError
    with pytest.raises(ConfigError, match=r"'topology.bandwidth' = inf .*finite"):
        Simulation(cfg, trace=chain_trace(batch=8))
    cfg.topology.bandwidth = 10e9
    cfg.batch_size = 6
    with pytest.raises(ConfigError, match=r"'batch_size' = 6 .*a multiple of 4"):
        Simulation(cfg, trace=chain_trace(batch=8))
    cfg.batch_size = 8
    assert Simulation(cfg, trace=chain_trace(batch=8)).config.topology.bandwidth == 10e9


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("paralelism", "parallelism"), ("topolgy", "topology"), ("num_gpu", "num_gpus")],
)
def test_a_misspelt_section_or_field_is_named_with_what_was_meant(typo, meant):
    """The top level lists its sections beside its own fields, so a misspelt section gets
    the same "did you mean" as a misspelt field."""
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
        from_dict({"trace": "t.json", typo: {"mode": "dp"} if typo != "num_gpu" else 2})


def test_the_replay_models_refusal_says_the_setting_in_the_configs_words():
    """Issue 44: perfmodel 'trace' asked for another batch printed an internal
    `Target(gpu=None, batch_size=4.0, tp=1)`; it now says the batch per GPU."""
    from tests.conftest import chain_trace
    from triosim.common.errors import ConfigError
    from triosim.simulation.wiring import Simulation

    cfg = {"num_gpus": 2, "parallelism": {"mode": "ddp"}, "perfmodel": {"kind": "trace"}}
    with pytest.raises(ConfigError) as e:
        Simulation(cfg, trace=chain_trace(batch=8)).run()
    msg = str(e.value)
    assert "perfmodel.kind" in msg and "batch 4 per GPU" in msg and "Target(" not in msg
