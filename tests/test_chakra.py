"""Chakra execution traces in and out: a run exported and imported again is the same run
(iteration time and every GPU's timeline, exactly) for each mode; the files follow Chakra's
schema as a decoder written here from the published schema reads it (field numbers and wire
types, not this package's classes); node counts and sizes match the run; ASTRA-sim's kinds
of workload (a microbenchmark collective, a ring of sends and receives with compute between)
run; each bad input is a clear error and leaves nothing half-written."""

from __future__ import annotations

import argparse
import os
import re
import struct
from pathlib import Path

import pytest

pytest.importorskip("google.protobuf")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.conftest import chain_trace  # noqa: E402
from triosim.common.errors import ConfigError, InputError, TraceError  # noqa: E402
from triosim.simulation.chakra_export import export_chakra  # noqa: E402
from triosim.simulation.wiring import Simulation  # noqa: E402
from triosim.trace import chakra as et  # noqa: E402
from triosim.trace.model import save  # noqa: E402

RING = {"kind": "ring", "bandwidth": 10e9, "latency": 1e-6}
COLUMNS = ["gpu", "stream", "kind", "name", "layer", "phase", "start", "end", "nbytes", "key"]
COLUMNS += ["iteration", "op_id", "microbatch"]


def config(mode, n=4, iterations=1, **par):
    return {
        "num_gpus": n,
        "iterations": iterations,
        "parallelism": {"mode": mode, **par},
        "topology": RING,
        "communication": {"kind": "textbook"},
    }


def rows(result, gpu=None):
    t = result.timeline
    if gpu is not None:
        t = t[t["gpu"] == gpu]
    return sorted(tuple(str(v) for v in r) for r in t[COLUMNS].itertuples(index=False))


MODES = [
    ("ddp", 4, {}),
    ("dp", 4, {}),
    ("tp", 4, {}),
    ("gpipe", 4, {"microbatches": 4}),
    ("1f1b", 4, {"microbatches": 4}),
    ("fsdp", 4, {}),
    ("fsdp", 4, {"stage": 2}),
    ("3d", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}),
    ("single", 1, {}),
    ("hybrid", 4, {"dp": 2, "inner": "gpipe", "microbatches": 2}),
    ("interleaved", 4, {"pp": 2, "dp": 2, "microbatches": 4}),
]


@pytest.fixture(scope="module")
def trace():
    # durations that are not whole microseconds: duration_micros alone would not bring
    # them back
    return chain_trace(layers=8, t_fwd=1.2345678e-3, t_bwd=2.3456789e-3, t_opt=0.4567891e-3)


@pytest.mark.parametrize(("mode", "n", "par"), MODES, ids=lambda v: str(v))
def test_export_then_import_is_the_same_run(tmp_path, trace, mode, n, par):
    ex = export_chakra(config(mode, n, **par), tmp_path, trace=trace)
    back = Simulation(config("chakra", n, path=str(tmp_path)), trace=trace).run()
    assert back.iteration_time == ex.result.iteration_time  # exactly
    for g in ex.result.gpus:
        assert rows(back, g) == rows(ex.result, g), f"GPU {g}"
    assert len(back.timeline) == len(ex.result.timeline)


def test_iterations_come_back_too(tmp_path, trace):
    # one iteration is exported; an import run of K iterations repeats it as the mode does
    ex = export_chakra(config("1f1b", 4, microbatches=2), tmp_path, trace=trace)
    want = Simulation(config("1f1b", 4, iterations=3, microbatches=2), trace=trace).run()
    back = Simulation(config("chakra", 4, iterations=3, path=str(tmp_path)), trace=trace).run()
    assert back.iteration_times == want.iteration_times
    assert rows(back) == rows(want)
    assert ex.files[-1].name == "comm_group.json"


def test_slower_gpus_are_in_the_exported_durations(tmp_path, trace):
    # the durations are what each GPU runs (its compute factor applied): an import run on
    # the same links without the factors is the same run
    slow = {**config("ddp", 4), "heterogeneity": {"compute": {2: 1.7}, "bandwidth": {1: 3.0}}}
    ex = export_chakra(slow, tmp_path, trace=trace)
    back = {**config("chakra", 4, path=str(tmp_path)), "heterogeneity": {"bandwidth": {1: 3.0}}}
    back = Simulation(back, trace=trace).run()
    assert back.iteration_time == ex.result.iteration_time
    assert rows(back) == rows(ex.result)


def test_a_config_file_names_the_workload_relative_to_itself(tmp_path, trace):
    save(trace, tmp_path / "t.trace.json")
    export_chakra(config("tp", 4), tmp_path / "et", trace=trace, prefix="gpt")
    import yaml

    from triosim.config.loading import load_config

    cfg = config("chakra", 4, path="et/gpt")  # (no trace: mode chakra refuses one)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = Simulation(load_config(tmp_path / "c.yaml")).run()
    assert r.iteration_time == Simulation(config("tp", 4), trace=trace).run().iteration_time


def test_a_workload_needs_no_trace(tmp_path, trace):
    """A Chakra workload carries its own times: a config that names no trace runs it, to the
    same result as with the trace that made it; every other mode still requires one."""
    import yaml

    from triosim.common.errors import ConfigError
    from triosim.config.loading import load_config

    ex = export_chakra(config("1f1b", 4, microbatches=2), tmp_path / "et", trace=trace)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config("chakra", 4, path="et")))
    back = Simulation(load_config(tmp_path / "c.yaml")).run()
    assert back.iteration_time == ex.result.iteration_time
    for g in ex.result.gpus:
        assert rows(back, g) == rows(ex.result, g), f"GPU {g}"
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(config("1f1b", 4, microbatches=2)))
    with pytest.raises(ConfigError, match="'trace'.*required.*mode 1f1b"):
        load_config(tmp_path / "d.yaml")


def test_a_trace_or_gpu_named_for_mode_chakra_is_refused_not_ignored(tmp_path, trace):
    """mode chakra times nothing (issue 44: a `gpu:` or `trace:` in its config was accepted
    and ignored): each is refused naming the field; a trace a Python caller passes along
    (as for any mode) builds no performance model and changes nothing."""
    ex = export_chakra(config("ddp", 4), tmp_path, trace=trace)
    cfg = config("chakra", 4, path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"'gpu' = 'A100-80GB'.*nothing would read"):
        Simulation({**cfg, "gpu": "A100-80GB"})
    saved = save(trace, tmp_path / "t.trace.json.gz")
    with pytest.raises(ConfigError, match=r"'trace' = .*nothing would read"):
        Simulation({**cfg, "trace": str(saved)})
    back = Simulation(cfg, trace=trace).run()
    assert back.iteration_time == ex.result.iteration_time


# -- the files as a reader written from Chakra's published schema sees them ----------------------
# Chakra's et_def.proto, written down: GlobalMetadata {1: version (string), 2: attr (message)};
# Node {1: id, 2: name, 3: type, 4: ctrl_deps (packed), 5: data_deps (packed),
# 6: start_time_micros, 7: duration_micros, 8/9: inputs/outputs, 10: attr};
# AttributeProto {1: name, 3: double_val, 7: int32_val, 9: int64_val, 13: uint64_val,
# 27: bool_val, 28: bool_list, 29: string_val}; NodeType COMP 4, SEND 5, RECV 6, COLL 7.
# A file: messages each preceded by their length as a varint (Chakra's protolib).


def _varint(buf, i):
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf):
    """{field number: [values]}: varints as ints, 64-bit as bytes, length-delimited as bytes."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 1:
            v, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        elif wire == 5:
            v, i = buf[i : i + 4], i + 4
        else:
            raise AssertionError(f"wire type {wire}")
        out.setdefault(num, []).append((wire, v))
    return out


def _messages(data):
    i = 0
    while i < len(data):
        n, i = _varint(data, i)
        yield data[i : i + n]
        i += n


def _packed(v):
    vals, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        vals.append(x)
    return vals


def decode_file(path):
    """(version, [node dicts]) read with the rules above, nothing of triosim's."""
    msgs = list(_messages(Path(path).read_bytes()))
    meta = _fields(msgs[0])
    assert set(meta) <= {1, 2}
    version = meta[1][0][1].decode() if 1 in meta else ""
    nodes = []
    for m in msgs[1:]:
        f = _fields(m)
        assert set(f) <= set(range(1, 11)), set(f)
        node = {
            "id": f.get(1, [(0, 0)])[0][1],
            "name": f[2][0][1].decode() if 2 in f else "",
            "type": f.get(3, [(0, 0)])[0][1],
            "ctrl_deps": _packed(f[4][0][1]) if 4 in f else [],
            "data_deps": _packed(f[5][0][1]) if 5 in f else [],
            "duration_micros": f.get(7, [(0, 0)])[0][1],
            "attr": {},
        }
        assert all(w == 0 for w, _ in f.get(1, []) + f.get(3, []) + f.get(7, []))
        for wire, a in f.get(10, []):
            assert wire == 2
            af = _fields(a)
            name = af[1][0][1].decode()
            (num, [(w, v)]), *rest = [(k, vs) for k, vs in af.items() if k != 1]
            assert not rest
            if num == 3:
                value = struct.unpack("<d", v)[0]
            elif num in (7, 9, 13):
                value = v
            elif num == 27:
                value = bool(v)
            elif num == 29:
                value = v.decode()
            else:
                raise AssertionError(f"attribute {name}: field {num}")
            node["attr"][name] = (num, value)
        nodes.append(node)
    return version, nodes


def test_the_files_follow_chakras_schema_and_match_the_run(tmp_path, trace):
    ex = export_chakra(config("3d", 8, dp=2, tp=2, pp=2, microbatches=2), tmp_path, trace=trace)
    res = ex.result
    tl = res.timeline
    for r, g in enumerate(res.gpus):
        version, nodes = decode_file(tmp_path / f"workload.{r}.et")
        assert version == "0.0.4"
        assert len(nodes) == ex.nodes[r]
        ids = [n["id"] for n in nodes]
        assert ids == list(range(len(nodes)))  # a topological order: deps on earlier nodes
        for n in nodes:
            assert all(d < n["id"] for d in n["ctrl_deps"] + n["data_deps"])
        # a stream's order: each node's ctrl_deps name the one before it on its stream; a
        # Wait's data_deps name the Signal of its key (so any reader keeps both orders)
        last: dict = {}
        signal_of = {}
        for n in nodes:
            a = n["attr"]
            s = a["triosim.stream"][1]
            assert n["ctrl_deps"] == ([last[s]] if s in last else [])
            last[s] = n["id"]
            if "triosim.signal" in a:
                signal_of[a["triosim.signal"][1]] = n["id"]
            if "triosim.wait" in a:
                assert n["data_deps"] == [signal_of[a["triosim.wait"][1]]]
            else:
                assert n["data_deps"] == []
        assert signal_of  # 3d's streams meet
        mine = tl[tl["gpu"] == g]
        by_type = {t: [n for n in nodes if n["type"] == t] for t in (4, 5, 6, 7)}
        work = [n for n in by_type[4] if not n["attr"]["is_cpu_op"][1]]
        assert len(work) == (mine["kind"] == "compute").sum()
        # ASTRA-sim's attribute types: is_cpu_op bool, comm_type/comm_size int64, comm_src/
        # comm_dst/comm_tag int32, pg_name string
        for n in by_type[7]:
            a = n["attr"]
            assert a["comm_type"][0] == 9 and a["comm_size"][0] == 9 and a["pg_name"][0] == 29
            key, nbytes = a["triosim.key"][1], a["triosim.nbytes"][1]
            row = mine[(mine["key"] == key) & (mine["kind"] == "comm")]
            assert len(row) == 1 and row["nbytes"].iloc[0] == nbytes
            assert a["comm_size"][1] == round(nbytes)  # 3d's collectives: all-reduces
        for n in by_type[5] + by_type[6]:
            a = n["attr"]
            assert {a[k][0] for k in ("comm_src", "comm_dst", "comm_tag")} == {7}
            assert (a["comm_src"][1] == r) == (n["type"] == 5)
        sends = (mine["name"].astype(str).str.startswith("send to")).sum()
        recvs = (mine["name"].astype(str).str.startswith("recv from")).sum()
        colls = (mine["kind"] == "comm").sum() - sends
        assert (len(by_type[5]), len(by_type[6]), len(by_type[7])) == (sends, recvs, colls)
        # durations: whole microseconds for ASTRA-sim, the exact seconds beside them
        for n in work:
            d = n["attr"]["triosim.duration"][1]
            assert n["duration_micros"] == round(d * 1e6)


def test_the_schema_file_builds_chakras_field_numbers():
    cls = et.messages()
    node = cls["Node"].DESCRIPTOR
    want = {"id": 1, "name": 2, "type": 3, "ctrl_deps": 4, "data_deps": 5}
    want.update(start_time_micros=6, duration_micros=7, inputs=8, outputs=9, attr=10)
    assert {f.name: f.number for f in node.fields} == want
    attr = cls["AttributeProto"].DESCRIPTOR
    assert [f.number for f in attr.oneofs_by_name["value"].fields] == list(range(3, 33))
    assert node.file.package == "ChakraProtoMsg"
    assert node.fields_by_name["type"].enum_type.values_by_name["COMM_COLL_NODE"].number == 7


def test_all_gathers_are_sized_as_astra_sim_sizes_them(tmp_path, trace):
    # fsdp's all-gathers: comm_size is what each rank contributes (ASTRA-sim's convention)
    export_chakra(config("fsdp", 4), tmp_path, trace=trace)
    _, nodes = decode_file(tmp_path / "workload.0.et")
    gathers = [n["attr"] for n in nodes if n["type"] == 7 and n["attr"]["comm_type"][1] == 2]
    assert gathers
    for a in gathers:
        assert a["comm_size"][1] == round(a["triosim.nbytes"][1] / 4)


# -- ASTRA-sim's kinds of workload, built here --------------------------------------------------


def write_rank(folder, rank, nodes, prefix="w", version="0.0.4"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}.{rank}.et"
    path.write_bytes(et.frame(et.encode_metadata({}, version)))
    with open(path, "ab") as f:
        for n in nodes:
            f.write(et.frame(et.encode_node(n)))
    return path


def coll(id, op=0, size=2**20, pg=None, deps=()):
    a = {"is_cpu_op": False, "comm_type": op, "comm_size": size}
    if pg is not None:
        a["pg_name"] = pg
    return et.Node(id, f"coll{id}", et.COMM_COLL_NODE, data_deps=list(deps), attrs=a)


def comp(id, us, deps=(), ctrl=()):
    return et.Node(id, f"comp{id}", et.COMP_NODE, list(ctrl), list(deps), us, {"is_cpu_op": False})


def run(folder, n, trace, comm="textbook", **top):
    topo = {**RING, **top}
    cfg = {**config("chakra", n, path=str(folder)), "topology": topo}
    cfg["communication"] = {"kind": comm}
    return Simulation(cfg, trace=trace).run()


@pytest.mark.parametrize("n", [4, 8])
def test_an_astra_sim_microbenchmark_all_reduce(tmp_path, trace, n):
    # as ASTRA-sim's examples/workload/microbenchmarks/all_reduce/<n>npus_1MB: one
    # collective node per rank, its id the rank, no pg_name (every rank), 1 MiB
    for r in range(n):
        write_rank(tmp_path, r, [coll(r)], prefix="all_reduce")
    res = run(tmp_path, n, trace)
    s, b, lat = 2**20, RING["bandwidth"], RING["latency"]
    want = 2 * (n - 1) / n * s / b + 2 * (n - 1) * lat  # the textbook ring all-reduce
    assert res.iteration_time == pytest.approx(want, rel=1e-9)


def test_collective_sizes_follow_astra_sims_conventions(tmp_path, trace):
    # ALL_GATHER's comm_size is what each rank sends: the gathered buffer is n times it
    for r in range(4):
        write_rank(tmp_path, r, [coll(0, op=2, size=1000)])
    res = run(tmp_path, 4, trace)
    assert set(res.timeline["nbytes"]) == {4000.0}


def test_a_ring_of_sends_and_receives_with_compute_between(tmp_path, trace):
    # as ASTRA-sim's custom collectives: each rank sends to the next, receives from the
    # previous, and a compute node waits on the receive (a data dependency)
    n, size = 4, 10**6
    for r in range(n):
        send = et.Node(0, "s", et.COMM_SEND_NODE, attrs={"comm_dst": (r + 1) % n})
        send.attrs.update(comm_size=size, comm_tag=0)
        recv = et.Node(1, "r", et.COMM_RECV_NODE, attrs={"comm_src": (r - 1) % n})
        recv.attrs.update(comm_size=size, comm_tag=0)
        write_rank(tmp_path, r, [send, recv, comp(2, 7, deps=[1])])
    res = run(tmp_path, n, trace)
    hop = size / RING["bandwidth"] + RING["latency"]
    assert res.iteration_time == pytest.approx(hop + 7e-6, rel=1e-9)


def test_dependencies_across_streams_overlap_compute_with_communication(tmp_path, trace):
    # comp 0 (10 us) -> all-reduce 1 (data dep) and comp 2 (ctrl dep on 0) run together;
    # comp 3 waits on both: it starts when the later of the two ends
    for r in range(2):
        write_rank(
            tmp_path,
            r,
            [comp(0, 10), coll(1, deps=[0]), comp(2, 5, ctrl=[0]), comp(3, 1, deps=[1, 2])],
        )
    res = run(tmp_path, 2, trace)
    ar = 2**20 / RING["bandwidth"] + 2 * RING["latency"]  # ring all-reduce on 2 GPUs
    assert res.iteration_time == pytest.approx(10e-6 + max(ar, 5e-6) + 1e-6, rel=1e-9)
    tl = res.timeline
    c2 = tl[(tl["name"] == "comp2") & (tl["gpu"] == tl["gpu"].iloc[0])]
    assert c2["start"].iloc[0] == pytest.approx(10e-6)  # beside the all-reduce, not after


def test_communicator_groups_come_from_comm_group_json(tmp_path, trace):
    for r in range(4):
        write_rank(tmp_path, r, [coll(0, pg="1" if r < 2 else "2")])
    (tmp_path / "comm_group.json").write_text('{"1": [0, 1], "2": [2, 3]}')
    res = run(tmp_path, 4, trace)
    assert res.iteration_time == pytest.approx(2**20 / RING["bandwidth"] + 2e-6, rel=1e-9)


ASTRA = os.environ.get("TRIOSIM_ASTRA_SIM_EXAMPLES")  # astra-sim's examples/ folder


@pytest.mark.skipif(not ASTRA, reason="set TRIOSIM_ASTRA_SIM_EXAMPLES to astra-sim/examples")
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_astra_sims_published_microbenchmarks(trace, op):
    folder = Path(ASTRA) / "workload" / "microbenchmarks" / op / "4npus_1MB"
    res = run(folder, 4, trace)
    n, s, b, lat = 4, 2**20, RING["bandwidth"], RING["latency"]
    want = {  # the textbook ring algorithms; all-to-all: direct, through the ring's links
        "all_reduce": 2 * (n - 1) / n * s / b + 2 * (n - 1) * lat,
        "all_gather": (n - 1) / n * (n * s) / b + (n - 1) * lat,  # comm_size: each rank's
        "reduce_scatter": (n - 1) / n * s / b + (n - 1) * lat,
    }
    if op in want:
        assert res.iteration_time == pytest.approx(want[op], rel=1e-9)
    assert len(res.timeline) == n


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path, trace):
    export_chakra(config("ddp", 4), tmp_path / "w", trace=trace)
    return tmp_path / "w"


def test_a_file_that_is_not_a_chakra_stream(exported, trace):
    (exported / "workload.2.et").write_bytes(b"this is a text file, not a trace\n")
    with pytest.raises(TraceError, match=r"workload\.2\.et.*not a Chakra stream"):
        run(exported, 4, trace)


def test_a_file_that_is_a_node_without_metadata(exported, trace):
    data = (exported / "workload.1.et").read_bytes()
    first = next(_messages(data))
    rest = data[len(et.varint(len(first))) + len(first) :]
    (exported / "workload.1.et").write_bytes(rest)  # the nodes, no GlobalMetadata
    with pytest.raises(TraceError, match="not a Chakra stream"):
        run(exported, 4, trace)


def test_a_protobuf_stream_of_other_messages(exported, trace):
    # well-formed protobuf, but field 15 of a varint is nothing in Chakra's GlobalMetadata
    (exported / "workload.0.et").write_bytes(et.frame(bytes([0x78, 0x01])))
    with pytest.raises(TraceError, match="not a Chakra stream.*fields the Chakra schema"):
        run(exported, 4, trace)


def test_a_truncated_stream(exported, trace):
    data = (exported / "workload.3.et").read_bytes()
    (exported / "workload.3.et").write_bytes(data[: len(data) - 5])
    with pytest.raises(TraceError, match=r"workload\.3\.et.*truncated stream"):
        run(exported, 4, trace)


def test_ranks_missing_or_duplicated(exported, trace):
    (exported / "workload.2.et").unlink()
    with pytest.raises(ConfigError, match=r"rank\(s\) \[2\] missing"):
        run(exported, 4, trace)
    (exported / "workload.02.et").write_bytes((exported / "workload.0.et").read_bytes())
    (exported / "workload.2.et").write_bytes((exported / "workload.0.et").read_bytes())
    with pytest.raises(ConfigError, match="rank 2 has"):
        run(exported, 4, trace)


def test_ranks_and_gpus_must_agree(exported, trace):
    with pytest.raises(ConfigError, match="number of ranks"):
        run(exported, 8, trace)


def test_a_dependency_on_a_node_that_does_not_exist(tmp_path, trace):
    for r in range(2):
        write_rank(tmp_path, r, [comp(0, 1), comp(1, 1, deps=[7] if r else [0])])
    with pytest.raises(TraceError, match=r"w\.1\.et.*data_deps.*depends on node 7"):
        run(tmp_path, 2, trace)


def test_a_dependency_cycle(tmp_path, trace):
    write_rank(tmp_path, 0, [comp(0, 1, deps=[1]), comp(1, 1, deps=[0])])
    with pytest.raises(TraceError, match="cycle"):
        run(tmp_path, 1, trace)


@pytest.mark.parametrize(
    ("nodes_of_rank_1", "match"),
    [
        # exact byte counts (not 1.04858e+06)
        ([coll(0, size=999)], "to agree.*of 1048576 bytes.*of 999 bytes"),
        ([coll(0, op=7)], "to agree.*allreduce.*reduce_scatter"),
        ([coll(0, pg="1")], "every member.*over ranks \\[0, 1, 2\\].*\\[1\\] do not"),
        ([], "every member.*rank\\(s\\) \\[1\\] do not"),
    ],
)
def test_a_collective_whose_members_disagree(tmp_path, trace, nodes_of_rank_1, match):
    (tmp_path / "comm_group.json").write_text('{"1": [0, 1]}')
    for r in range(3):
        write_rank(tmp_path, r, nodes_of_rank_1 if r == 1 else [coll(0)])
    with pytest.raises(ConfigError, match=match):
        run(tmp_path, 3, trace)


def test_a_send_without_its_receive(tmp_path, trace):
    send = et.Node(0, "s", et.COMM_SEND_NODE, attrs={"comm_dst": 1, "comm_size": 8})
    write_rank(tmp_path, 0, [send])
    write_rank(tmp_path, 1, [comp(0, 1)])
    with pytest.raises(ConfigError, match="a receive for every send"):
        run(tmp_path, 2, trace)


def test_an_unknown_group_and_an_unsupported_collective(tmp_path, trace):
    write_rank(tmp_path, 0, [coll(0, pg="5")])
    with pytest.raises(TraceError, match="communicator group '5'"):
        run(tmp_path, 1, trace)
    write_rank(tmp_path, 0, [coll(0, op=3)])  # GATHER
    with pytest.raises(TraceError, match="GATHER is not simulated"):
        run(tmp_path, 1, trace)


def test_export_writes_everything_or_nothing(tmp_path, trace, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    calls = []
    real = Path.write_bytes

    def failing(self, data):
        calls.append(self)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", failing)
    with pytest.raises(InputError, match="No space left on device.*nothing was written"):
        export_chakra(config("ddp", 4), out, trace=trace, force=True)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # no file, no partial
    with pytest.raises(InputError, match="already holds files.*pass --force"):
        export_chakra(config("ddp", 4), out, trace=trace)  # as simulate --out: checked first
    export_chakra(config("ddp", 4), out, trace=trace, force=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError, match="pass --force"):
        export_chakra(config("tp", 4), out, trace=trace)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    export_chakra(config("tp", 4), out, trace=trace, force=True)
    assert {p.name for p in out.iterdir()} == set(before)
    assert (out / "mine.txt").read_text() == "a user's file"


def test_a_mode_chakra_cannot_hold_is_refused(tmp_path, trace):
    with pytest.raises(ConfigError, match="k of n"):
        export_chakra(config("hop", 4), tmp_path, trace=trace)
    assert not any(tmp_path.iterdir())


# -- the stream format ----------------------------------------------------------------------------

nodes_st = st.lists(
    st.builds(
        lambda i, us, deps, name, size: et.Node(
            i, name, et.COMP_NODE, [], deps, us, {"comm_size": size, "x": float(us)}
        ),
        st.integers(0, 2**40),
        st.integers(0, 2**40),
        st.lists(st.integers(0, 2**63), max_size=4),
        st.text(max_size=12),
        st.integers(0, 2**62),
    ),
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(nodes_st, st.data())
def test_streams_decode_as_written_and_any_cut_is_found(nodes, data):
    blob = et.encode_stream({"k": "v"}, nodes)
    msgs = list(_messages(blob))  # the independent reader
    assert len(msgs) == len(nodes) + 1
    for n, m in zip(nodes, msgs[1:], strict=True):
        f = _fields(m)
        assert f.get(1, [(0, 0)])[0][1] == n.id
        assert (_packed(f[5][0][1]) if 5 in f else []) == n.data_deps
        assert f.get(7, [(0, 0)])[0][1] == n.duration_micros
    # a cut anywhere but between two messages is a truncated stream
    bounds, i = {0}, 0
    for m in msgs:
        i += len(et.varint(len(m))) + len(m)
        bounds.add(i)
    cut = data.draw(st.integers(1, len(blob) - 1))
    if cut not in bounds:
        with pytest.raises(TraceError, match="truncated"):
            list(et._frames(blob[:cut], "f"))


# -- the command ----------------------------------------------------------------------------------


def test_the_export_command(tmp_path, trace, capsys):
    from triosim.cli import chakra

    save(trace, tmp_path / "t.trace.json")
    import yaml

    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump({**config("gpipe", 4), "trace": "t.trace.json"})
    )
    p = argparse.ArgumentParser()
    chakra.add_parser(p.add_subparsers())
    args = p.parse_args(["export-chakra", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o")])
    args.set = ["parallelism.microbatches=2"]
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "gpipe on 4 GPUs" in out and "--workload-configuration=" in out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        ".triosim-files",  # the manifest: what a later --force may remove
        "comm_group.json",
        *(f"workload.{r}.et" for r in range(4)),
    ]
    with pytest.raises(InputError, match="pass --force"):
        args.func(args)


# -- what a new user ran into -------------------------------------------------------------------


def _cut_between_messages(path, keep):
    """The file with its GlobalMetadata and only its first `keep` nodes: a well-formed
    stream, cut at a message boundary."""
    msgs = list(_messages(path.read_bytes()))
    path.write_bytes(b"".join(et.frame(m) for m in msgs[: 1 + keep]))
    return len(msgs) - 1


def test_a_triosim_export_cut_between_messages_is_caught(exported, trace):
    f = exported / "workload.1.et"
    total = len(list(_messages(f.read_bytes()))) - 1
    _cut_between_messages(f, keep=total // 2)
    with pytest.raises(
        TraceError,
        match=rf"workload\.1\.et.*truncated stream.*says {total} nodes.*holds {total // 2}",
    ):
        run(exported, 4, trace)
    # another writer's file carries no count: a cut between its messages cannot be seen
    meta = et.read_rank_file(exported / "workload.0.et", 0).metadata
    assert meta[et.A_NODES] == len(list(_messages((exported / "workload.0.et").read_bytes()))) - 1


def test_a_folder_where_a_file_goes_is_refused_before_anything_moves(exported, trace):
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    (exported / "workload.2.et").unlink()
    (exported / "workload.2.et").mkdir()
    with pytest.raises(InputError, match=r"workload\.2\.et is a folder"):
        export_chakra(config("tp", 4), exported, trace=trace, force=True)
    for name in ("workload.0.et", "workload.1.et", "workload.3.et", "comm_group.json"):
        assert (exported / name).read_bytes() == before[name]
    assert not [p for p in exported.iterdir() if "partial" in p.name or "earlier" in p.name]


def test_a_rename_that_fails_puts_the_earlier_export_back(exported, trace, monkeypatch):
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    real, calls = os.replace, []

    def failing(src, dst):
        calls.append(dst)
        if Path(dst).name == "workload.2.et" and ".partial-" in Path(src).name:
            raise OSError(21, "Is a directory")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(InputError, match=r"cannot write workload\.2\.et.*nothing was written"):
        export_chakra(config("tp", 4), exported, trace=trace, force=True)
    monkeypatch.undo()
    assert calls  # the renames were reached
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before  # ddp's, whole


def test_force_removes_the_files_an_earlier_export_wrote_and_nothing_else(tmp_path, trace):
    out = tmp_path / "o"
    export_chakra(config("ddp", 8), out, trace=trace)
    (out / "notes.txt").write_text("mine")
    (out / "w.9.et").write_bytes(b"not triosim's")  # a user's file, not in the manifest
    ex = export_chakra(config("ddp", 4), out, trace=trace, force=True)
    assert sorted(ex.removed) == [f"workload.{r}.et" for r in range(4, 8)]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [".triosim-files", "comm_group.json", "notes.txt", "w.9.et"]
        + [f"workload.{r}.et" for r in range(4)]
    )
    back = run(out / "workload", 4, trace)
    assert back.iteration_time == ex.result.iteration_time


def test_ranks_of_an_earlier_export_beside_a_later_one(tmp_path, trace):
    big, small = tmp_path / "big", tmp_path / "small"
    export_chakra(config("ddp", 8), big, trace=trace)
    export_chakra(config("ddp", 4), small, trace=trace)
    with pytest.raises(
        ConfigError, match=r"holds ranks 0-7 \(.*\); num_gpus is 4: an earlier export"
    ):
        run(big, 4, trace)
    for r in range(4):  # a 4-rank export over an 8-rank one, by hand (no --force)
        (big / f"workload.{r}.et").write_bytes((small / f"workload.{r}.et").read_bytes())
    with pytest.raises(ConfigError, match=r"holds ranks 0-7, but workload\.0\.et was exported "):
        run(big, 8, trace)


def test_the_folder_is_checked_before_simulating(tmp_path, trace, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    (out / "unrelated.csv").write_text("a,b\n")

    def no_run(self):
        raise AssertionError("simulated before the folder was checked")

    monkeypatch.setattr(Simulation, "run", no_run)
    with pytest.raises(InputError, match="already holds files; pass --force"):
        export_chakra(config("ddp", 4), out, trace=trace)
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        export_chakra(config("ddp", 4), tmp_path / "f", trace=trace)
    # an input of the run is never written over, not even with --force
    save(trace, out / "comm_group.json")
    cfg = {**config("ddp", 4), "trace": str(out / "comm_group.json")}
    with pytest.raises(InputError, match="comm_group.json is an input of this run"):
        export_chakra(cfg, out, force=True)


def test_a_workload_without_a_trace_has_no_memory_figures(tmp_path, trace):
    import yaml

    from triosim.config.loading import load_config

    export_chakra(config("ddp", 4), tmp_path / "et", trace=trace)
    cfg = {**config("chakra", 4, path="et"), "memory": {"capacity": "80 GB"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = Simulation(load_config(tmp_path / "c.yaml")).run()
    s = r.summary()
    assert "0.000 GB" not in s
    assert re.search(r"peak memory / GPU \(max\) +n/a\n", s)
    assert re.search(r"fits in memory +unknown \(a Chakra workload carries no tensors\)", s)
    d = r.summary_dict()
    assert d["peak_memory_gb_max"] is None and d["fits_in_memory"] is None
    assert r.out_of_memory() is None
    r.save(tmp_path / "res")
    assert not (tmp_path / "res" / "memory.csv").exists()
    assert not (tmp_path / "res" / "memory.png").exists()
    # a trace given beside the workload changes nothing: its operators are not run
    r2 = run(tmp_path / "et", 4, trace)
    assert r2.summary_dict()["peak_memory_gb_max"] is None


def test_a_batch_size_is_refused(exported, trace):
    cfg = {**config("chakra", 4, path=str(exported)), "batch_size": 16}
    with pytest.raises(ConfigError, match="'batch_size' = 16.*fixed at the batch"):
        Simulation(cfg, trace=trace)


def test_info_on_a_chakra_file_says_what_it_is(exported):
    from triosim.trace.files import load_any_trace

    with pytest.raises(InputError, match=r"workload\.0\.et is a Chakra execution trace.*chakra"):
        load_any_trace(exported / "workload.0.et")


def test_a_workload_folder_that_does_not_exist(tmp_path, trace):
    with pytest.raises(ConfigError, match=r"nope does not exist"):
        run(tmp_path / "nope", 4, trace)
    with pytest.raises(ConfigError, match=r"does not exist \(nor does its folder"):
        run(tmp_path / "a" / "b", 4, trace)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty holds none"):
        run(tmp_path / "empty", 4, trace)


def test_an_uneven_all_to_all_comes_back_with_its_per_pair_bytes(tmp_path):
    """Issue 44: mode ep with skewed expert loads posts all-to-alls whose members send
    different bytes; the export writes each one's per-pair table (triosim.sizes), so the
    workload imports (it was refused: the members' byte counts disagreed) and runs to the
    same timeline."""
    from tests.test_ep_tp import trace as moe_trace

    tr = moe_trace(layers=2, experts=4)
    cfg = {**config("ep", 4, ep=4, load="skew", skew=1.5), "batch_size": 4}
    ex = export_chakra(cfg, tmp_path, trace=tr)
    a2a = ex.result.timeline[ex.result.timeline["name"] == "all_to_all"]
    assert a2a.groupby("key")["nbytes"].nunique().max() > 1  # uneven: the test's point
    back = Simulation(config("chakra", 4, path=str(tmp_path))).run()
    assert back.iteration_time == ex.result.iteration_time
    for g in ex.result.gpus:
        assert rows(back, g) == rows(ex.result, g), f"GPU {g}"


@pytest.mark.parametrize(
    "mode, par", [("cp", {"cp": 2}), ("3d", {"dp": 2, "tp": 1, "pp": 1, "cp": 2})]
)
def test_ring_attention_is_refused_naming_cp_comm_and_ulysses_exports(tmp_path, mode, par):
    """Issue 44: ring attention's sends wait for both GPUs to reach each step (across
    ranks: no Chakra form); the export refuses it naming parallelism.cp_comm (it named
    `parallelism.mode = ''`), and Ulysses (a2a) exports and comes back to the same time;
    in mode cp and in 3d with cp 2 (item 14 named both)."""
    from tests.test_context_parallel import attention_trace

    tr = attention_trace(b=2, s=256, H=8, d=64)
    with pytest.raises(ConfigError, match=r"parallelism\.cp_comm' = 'p2p'.*a2a"):
        export_chakra({**config(mode, 4, **par), "batch_size": 2}, tmp_path / "p2p", trace=tr)
    ex = export_chakra(
        {**config(mode, 4, **par, cp_comm="a2a"), "batch_size": 2}, tmp_path / "a2a", trace=tr
    )
    back = Simulation(config("chakra", 4, path=str(tmp_path / "a2a"))).run()
    assert back.iteration_time == ex.result.iteration_time
