"""MLCommons Chakra execution traces (what ASTRA-sim reads): the schema, the file format, and
a workload of per-rank files read and checked.

A Chakra workload is one file per rank, `<prefix>.<rank>.et`: a stream of protobuf messages,
each preceded by its length as a varint, a `GlobalMetadata` first and then `Node`s (compute,
collective, send, receive, metadata) whose `ctrl_deps` and `data_deps` name other nodes of the
same file. Collectives name their communicator by `pg_name`; the members of each are in
`comm_group.json` beside the files (ASTRA-sim's `--comm-group-configuration`: `{"1": [0, 1]}`),
and an empty `pg_name` or "0" means every rank.

The schema is `chakra_et.proto` beside this module, read when first needed and built into
message classes with the `protobuf` runtime (the `chakra` extra); nothing else here needs it.
Everything a file can get wrong is a TraceError naming the file, the node and the field; what
a set of files gets wrong together (ranks, groups) is a ConfigError on `parallelism.path`.
"""

from __future__ import annotations

import gzip
import heapq
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from triosim.common.errors import ConfigError, InputError, TraceError

SCHEMA = Path(__file__).with_name("chakra_et.proto")
VERSION = "0.0.4"  # the GlobalMetadata version written (ASTRA-sim's examples carry it)
GROUPS_FILE = "comm_group.json"
FIELD = "parallelism.path"

# NodeType
INVALID_NODE, METADATA_NODE, MEM_LOAD_NODE, MEM_STORE_NODE = 0, 1, 2, 3
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
NODE_TYPES = {
    INVALID_NODE: "INVALID_NODE",
    METADATA_NODE: "METADATA_NODE",
    MEM_LOAD_NODE: "MEM_LOAD_NODE",
    MEM_STORE_NODE: "MEM_STORE_NODE",
    COMP_NODE: "COMP_NODE",
    COMM_SEND_NODE: "COMM_SEND_NODE",
    COMM_RECV_NODE: "COMM_RECV_NODE",
    COMM_COLL_NODE: "COMM_COLL_NODE",
}
# CollectiveCommType
COMM_TYPES = {
    0: "ALL_REDUCE",
    1: "REDUCE",
    2: "ALL_GATHER",
    3: "GATHER",
    4: "SCATTER",
    5: "BROADCAST",
    6: "ALL_TO_ALL",
    7: "REDUCE_SCATTER",
    8: "REDUCE_SCATTER_BLOCK",
    9: "BARRIER",
}
# the attributes ASTRA-sim reads, with the value field each must be written in
STANDARD_ATTRS = {
    "is_cpu_op": "bool_val",
    "num_ops": "int64_val",
    "tensor_size": "uint64_val",
    "comm_type": "int64_val",
    "comm_priority": "int32_val",
    "comm_size": "int64_val",
    "comm_src": "int32_val",
    "comm_dst": "int32_val",
    "comm_tag": "int32_val",
    "pg_name": "string_val",
    "involved_dim": "bool_list",
}


# -- the schema -------------------------------------------------------------------------------

_SCALARS = {  # .proto scalar type -> FieldDescriptorProto.Type
    "double": 1,
    "float": 2,
    "int64": 3,
    "uint64": 4,
    "int32": 5,
    "fixed64": 6,
    "fixed32": 7,
    "bool": 8,
    "string": 9,
    "bytes": 12,
    "uint32": 13,
    "sfixed32": 15,
    "sfixed64": 16,
    "sint32": 17,
    "sint64": 18,
}
_TOKENS = re.compile(r'"[^"]*"|[A-Za-z_][A-Za-z0-9_.]*|\d+|[{}=;]')


def parse_proto(text: str) -> dict:
    """The subset of proto3 a schema like chakra_et.proto uses (a package, enums, messages
    with scalar, message, enum, repeated and oneof fields) as {"package": str, "enums":
    {name: [(value name, number)]}, "messages": {name: [(label, type, name, number, oneof)]}}.
    Anything else is a ValueError: the schema is ours, so that is a bug, not bad input."""
    text = re.sub(r"//[^\n]*", "", text)
    tokens = _TOKENS.findall(text)
    out: dict = {"package": "", "enums": {}, "messages": {}}
    pos = 0

    def take(expected=None):
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("schema ends early")
        tok = tokens[pos]
        pos += 1
        if expected is not None and tok != expected:
            raise ValueError(f"schema: expected {expected!r}, got {tok!r}")
        return tok

    while pos < len(tokens):
        word = take()
        if word == "syntax":
            take("=")
            if take() != '"proto3"':
                raise ValueError("schema: proto3 only")
            take(";")
        elif word == "package":
            out["package"] = take()
            take(";")
        elif word == "enum":
            name, values = take(), []
            take("{")
            while tokens[pos] != "}":
                value = take()
                take("=")
                values.append((value, int(take())))
                take(";")
            take("}")
            out["enums"][name] = values
        elif word == "message":
            name, fields, oneof = take(), [], None
            take("{")
            while True:
                tok = take()
                if tok == "}":
                    if oneof is None:
                        break
                    oneof = None
                    continue
                if tok == "oneof":
                    oneof = take()
                    take("{")
                    continue
                label = "optional"
                if tok == "repeated":
                    label, tok = "repeated", take()
                fname = take()
                take("=")
                number = int(take())
                take(";")
                fields.append((label, tok, fname, number, oneof))
            out["messages"][name] = fields
        else:
            raise ValueError(f"schema: unexpected {word!r}")
    return out


_CLASSES: dict | None = None


def messages() -> dict:
    """{message name: class} built from chakra_et.proto with the protobuf runtime (an
    InputError saying how to install it when it is missing)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError:
        raise InputError(
            "Chakra execution traces need the protobuf runtime: "
            "pip install 'triosim[chakra]' (or pip install protobuf)"
        ) from None
    schema = parse_proto(SCHEMA.read_text(encoding="utf-8"))
    pkg = schema["package"]
    fdp = descriptor_pb2.FileDescriptorProto(
        name="triosim/chakra_et.proto", package=pkg, syntax="proto3"
    )
    for name, values in schema["enums"].items():
        e = fdp.enum_type.add(name=name)
        for vname, number in values:
            e.value.add(name=vname, number=number)
    F = descriptor_pb2.FieldDescriptorProto
    for name, fields in schema["messages"].items():
        m = fdp.message_type.add(name=name)
        oneofs: list = []
        for label, ftype, fname, number, oneof in fields:
            f = m.field.add(name=fname, number=number, json_name=_camel(fname))
            f.label = F.LABEL_REPEATED if label == "repeated" else F.LABEL_OPTIONAL
            if ftype in _SCALARS:
                f.type = _SCALARS[ftype]
            elif ftype in schema["enums"]:
                f.type, f.type_name = F.TYPE_ENUM, f".{pkg}.{ftype}"
            elif ftype in schema["messages"]:
                f.type, f.type_name = F.TYPE_MESSAGE, f".{pkg}.{ftype}"
            else:
                raise ValueError(f"schema: unknown type {ftype!r} of {name}.{fname}")
            if oneof is not None:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    m.oneof_decl.add(name=oneof)
                f.oneof_index = oneofs.index(oneof)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    fd = pool.FindFileByName(fdp.name)
    _CLASSES = {
        name: message_factory.GetMessageClass(fd.message_types_by_name[name])
        for name in schema["messages"]
    }
    return _CLASSES


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


# -- nodes ------------------------------------------------------------------------------------


@dataclass
class Node:
    """One node of a rank's graph, without the protobuf classes: `attrs` maps an
    attribute's name to its value (a bool, int, float, str or list)."""

    id: int
    name: str
    type: int
    ctrl_deps: list = field(default_factory=list)
    data_deps: list = field(default_factory=list)
    duration_micros: int = 0
    attrs: dict = field(default_factory=dict)

    @property
    def deps(self) -> list:
        """ctrl and data dependencies, each once, in order."""
        return list(dict.fromkeys([*self.ctrl_deps, *self.data_deps]))

    def kind(self) -> str:
        return NODE_TYPES.get(self.type, f"node type {self.type}")


def _attr_value(a):
    which = a.WhichOneof("value")
    if which is None:
        return None
    v = getattr(a, which)
    if which.endswith("_list"):
        return list(v.values)
    return v


def _set_attr(msg, name: str, value) -> None:
    a = msg.attr.add(name=name)
    kind = STANDARD_ATTRS.get(name)
    if kind is None:
        if isinstance(value, bool):
            kind = "bool_val"
        elif isinstance(value, int):
            kind = "int64_val"
        elif isinstance(value, float):
            kind = "double_val"
        elif isinstance(value, str):
            kind = "string_val"
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            kind = "string_list"
        elif isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
            kind = "int64_list"
        elif isinstance(value, (list, tuple)):
            kind = "double_list"
        else:
            raise TypeError(f"attribute {name!r}: cannot write {value!r}")
    if kind.endswith("_list"):
        getattr(a, kind).values.extend(value)
    else:
        setattr(a, kind, value)


def encode_node(node: Node) -> bytes:
    msg = messages()["Node"](
        id=node.id,
        name=node.name,
        type=node.type,
        ctrl_deps=node.ctrl_deps,
        data_deps=node.data_deps,
        duration_micros=node.duration_micros,
    )
    for name, value in node.attrs.items():
        _set_attr(msg, name, value)
    return msg.SerializeToString()


def encode_metadata(attrs: dict, version: str = VERSION) -> bytes:
    msg = messages()["GlobalMetadata"](version=version)
    for name, value in attrs.items():
        _set_attr(msg, name, value)
    return msg.SerializeToString()


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits, n = n & 0x7F, n >> 7
        if n:
            out.append(0x80 | bits)
        else:
            out.append(bits)
            return bytes(out)


def frame(payload: bytes) -> bytes:
    """One message of the stream: its length as a varint, then its bytes."""
    return varint(len(payload)) + payload


def encode_stream(metadata: dict, nodes) -> bytes:
    """A whole rank file: the GlobalMetadata, then every node, each length-delimited."""
    parts = [frame(encode_metadata(metadata))]
    parts += [frame(encode_node(n)) for n in nodes]
    return b"".join(parts)


# -- reading a rank file ---------------------------------------------------------------------


@dataclass
class RankFile:
    path: Path
    rank: int
    version: str
    metadata: dict
    nodes: list  # Node, in file order


def _frames(data: bytes, path):
    """(index, payload) of each length-delimited message; a TraceError where the stream is
    cut short (a length past the end, or a length that never ends)."""
    pos, index = 0, 0
    while pos < len(data):
        n, shift, start = 0, 0, pos
        while True:
            if pos >= len(data):
                raise TraceError(
                    f"truncated stream: message {index}'s length (at byte {start}) is cut off",
                    file=path,
                )
            b = data[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift > 63:
                raise TraceError(
                    f"not a Chakra stream: message {index}'s length at byte {start} "
                    "is not a varint",
                    file=path,
                )
        if pos + n > len(data):
            what = (
                "not a Chakra stream (or one truncated in its first message)"
                if not index
                else "truncated stream"
            )
            raise TraceError(
                f"{what}: message {index} (at byte {start}) needs {n} bytes, "
                f"{len(data) - pos} are left",
                file=path,
            )
        yield index, data[pos : pos + n]
        pos += n
        index += 1


def _parse(cls, payload: bytes, path, what: str):
    from google.protobuf.message import DecodeError

    msg = cls()
    try:
        msg.ParseFromString(payload)
    except DecodeError as e:
        raise TraceError(f"not a Chakra stream: {what} does not parse ({e})", file=path) from None
    with_unknown = msg.ByteSize()
    msg.DiscardUnknownFields()
    if msg.ByteSize() != with_unknown:
        raise TraceError(
            f"not a Chakra stream: {what} has fields the Chakra schema does not know",
            file=path,
        )
    return msg


def read_rank_file(path, rank: int) -> RankFile:
    """One rank's file, parsed and checked on its own (ids unique, dependencies on nodes of
    the file, no cycle, the attributes each node kind needs). gzip-compressed files are
    read too (as Chakra's tools do)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"Chakra file {path}: cannot read it ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise TraceError(f"truncated stream: gzip data is damaged ({e})", file=path) from None
    cls = messages()
    frames = _frames(data, path)
    first = next(frames, None)
    if first is None:
        raise TraceError("not a Chakra stream: the file is empty", file=path)
    meta = _parse(cls["GlobalMetadata"], first[1], path, "the first message (GlobalMetadata)")
    if not first[1]:
        raise TraceError(
            "not a Chakra stream: the first message (GlobalMetadata) is empty", file=path
        )
    nodes = []
    for index, payload in frames:
        m = _parse(cls["Node"], payload, path, f"message {index} (a Node)")
        nodes.append(
            Node(
                id=m.id,
                name=m.name,
                type=m.type,
                ctrl_deps=list(m.ctrl_deps),
                data_deps=list(m.data_deps),
                duration_micros=m.duration_micros,
                attrs={a.name: _attr_value(a) for a in m.attr},
            )
        )
    rf = RankFile(path, rank, meta.version, {a.name: _attr_value(a) for a in meta.attr}, nodes)
    want = rf.metadata.get(A_NODES)
    if type(want) is int and want != len(nodes):
        # a cut between two messages leaves a well-formed stream: only the count says so
        raise TraceError(
            f"truncated stream: the GlobalMetadata says {want} nodes ({A_NODES}), "
            f"the file holds {len(nodes)}",
            file=path,
        )
    check_rank(rf)
    return rf


def check_rank(rf: RankFile) -> None:
    """Within one file: known node types, unique ids, every dependency a node of the file,
    no cycle, and the attributes each communication node needs."""
    seen: dict = {}
    for row, n in enumerate(rf.nodes):
        if n.type not in NODE_TYPES:
            raise TraceError(f"node {n.id}: unknown node type {n.type}", rf.path, row, "type")
        if n.id in seen:
            raise TraceError(
                f"node id {n.id} is used twice (nodes {seen[n.id]} and {row})", rf.path, row, "id"
            )
        seen[n.id] = row
    for row, n in enumerate(rf.nodes):
        for d in n.deps:
            if d not in seen:
                which = "ctrl_deps" if d in n.ctrl_deps else "data_deps"
                raise TraceError(
                    f"node {n.id} ({n.name!r}) depends on node {d}, which is not in the file",
                    rf.path,
                    row,
                    which,
                )
        need = {
            COMM_COLL_NODE: ("comm_type", "comm_size"),
            COMM_SEND_NODE: ("comm_dst", "comm_size"),
            COMM_RECV_NODE: ("comm_src", "comm_size"),
        }.get(n.type, ())
        for a in need:
            if a not in n.attrs:
                raise TraceError(
                    f"node {n.id} ({n.kind()}) has no {a!r} attribute", rf.path, row, a
                )
    topological_order(rf)


def topological_order(rf: RankFile) -> list:
    """The nodes in an order where every node comes after its dependencies, ties broken by
    file order (Kahn's algorithm); a TraceError naming the nodes of a cycle."""
    pos = {n.id: i for i, n in enumerate(rf.nodes)}
    waiting = {n.id: len(n.deps) for n in rf.nodes}
    children: dict = {}
    for n in rf.nodes:
        for d in n.deps:
            children.setdefault(d, []).append(n.id)
    ready = [pos[i] for i, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = rf.nodes[heapq.heappop(ready)]
        order.append(n)
        for c in children.get(n.id, ()):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, pos[c])
    if len(order) != len(rf.nodes):
        stuck = sorted((i for i, k in waiting.items() if k > 0), key=pos.get)
        raise TraceError(
            f"the dependencies form a cycle: nodes {stuck[:10]}"
            + (f" and {len(stuck) - 10} more" if len(stuck) > 10 else "")
            + " wait on each other",
            rf.path,
            pos[stuck[0]],
            "ctrl_deps/data_deps",
        )
    return order


# -- a workload: the files of every rank ----------------------------------------------------

_RANK_NAME = re.compile(r"^(?P<prefix>.*)\.(?P<rank>\d+)\.et(?:\.gz)?$")


def rank_files(path) -> tuple[str, dict]:
    """(prefix, {rank: file}) of a workload given as a folder holding one set of
    `<prefix>.<rank>.et` files, or as the prefix itself (ASTRA-sim's
    --workload-configuration): ranks 0..N-1, each once."""
    path = Path(path)
    if path.is_dir():
        folder, prefix = path, None
    elif path.parent.is_dir():
        folder, prefix = path.parent, path.name
    else:
        raise ConfigError(
            FIELD,
            str(path),
            f"a folder of Chakra files or their path prefix; {path} does not exist "
            f"(nor does its folder {path.parent})",
        )
    found: dict = {}
    for f in sorted(folder.iterdir()):
        m = _RANK_NAME.match(f.name)
        if m is None or not f.is_file():
            continue
        if prefix is not None and m["prefix"] != prefix:
            continue
        found.setdefault(m["prefix"], {}).setdefault(int(m["rank"]), []).append(f)
    if not found and prefix is not None:
        raise ConfigError(
            FIELD,
            str(path),
            f"a folder of Chakra files or their path prefix; {path} does not exist, and "
            f"{folder} holds no {prefix}.<rank>.et files",
        )
    if not found:
        raise ConfigError(
            FIELD,
            str(path),
            f"a folder (or prefix) with Chakra files named <prefix>.<rank>.et; {path} holds none",
        )
    if len(found) > 1:
        raise ConfigError(
            FIELD,
            str(path),
            f"one set of Chakra files; found prefixes {sorted(found)} (name one: "
            f"{folder}/<prefix>)",
        )
    ((prefix, ranks),) = found.items()
    for r, files in ranks.items():
        if len(files) > 1:
            raise ConfigError(
                FIELD, str(path), f"one file per rank; rank {r} has {[f.name for f in files]}"
            )
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise ConfigError(
            FIELD,
            str(path),
            f"files for ranks 0..{max(ranks)}; rank(s) {missing[:10]} missing "
            f"(expected {prefix}.<rank>.et)",
        )
    return prefix, {r: fs[0] for r, fs in sorted(ranks.items())}


@dataclass
class Workload:
    folder: Path
    prefix: str
    ranks: list  # RankFile, by rank
    groups: dict  # pg_name -> tuple of ranks (comm_group.json; "" and "0": every rank)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def group(self, rf: RankFile, node: Node) -> tuple:
        pg = str(node.attrs.get("pg_name") or "")
        if pg in ("", "0") and pg not in self.groups:
            return tuple(range(self.num_ranks))
        if pg not in self.groups:
            raise TraceError(
                f"node {node.id}: communicator group {pg!r} is not in {GROUPS_FILE} "
                f"(groups there: {sorted(self.groups) or 'none'})",
                rf.path,
                field="pg_name",
            )
        return self.groups[pg]


def read_groups(folder: Path, num_ranks: int) -> dict:
    f = folder / GROUPS_FILE
    if not f.exists():
        return {}
    from triosim.trace.files import read_text

    try:
        raw = json.loads(read_text(f, "communicator groups file"))
    except json.JSONDecodeError as e:
        raise ConfigError(FIELD, str(f), f"JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(FIELD, str(f), 'a JSON object {"group id": [ranks]}')
    groups = {}
    for k, v in raw.items():
        if (
            not isinstance(v, list)
            or not v
            or not all(type(r) is int and 0 <= r < num_ranks for r in v)
            or len(set(v)) != len(v)
        ):
            raise ConfigError(
                FIELD,
                str(f),
                f"group {k!r}: a list of distinct ranks in 0..{num_ranks - 1}, got {v!r}",
            )
        groups[str(k)] = tuple(v)
    return groups


def load_workload(path) -> Workload:
    """Every rank's file, each checked, and the communicator groups."""
    prefix, files = rank_files(path)
    folder = next(iter(files.values())).parent
    ranks = [read_rank_file(f, r) for r, f in files.items()]
    for rf in ranks:  # triosim's exports say how many ranks they wrote
        said = rf.metadata.get("triosim.ranks")
        if type(said) is int and said != len(ranks):
            raise ConfigError(
                FIELD,
                str(path),
                f"one export's files; the folder holds ranks 0-{len(ranks) - 1}, but "
                f"{rf.path.name} was exported with {said} ranks (triosim.ranks): files of "
                "an earlier export beside a later one? (export again with --force, which "
                "removes them)",
            )
    return Workload(folder, prefix, ranks, read_groups(folder, len(ranks)))


# -- what triosim's tasks are in Chakra's terms -----------------------------------------------

# attributes triosim writes beside Chakra's own, so that an exported workload comes back
# exactly (ASTRA-sim keeps attributes it does not know aside and ignores them)
A_STREAM = "triosim.stream"  # the GPU stream the node runs on
A_DURATION = "triosim.duration"  # seconds, as a double (duration_micros is whole microseconds)
A_NBYTES = "triosim.nbytes"  # triosim's byte count (comm_size follows ASTRA-sim's convention)
A_KEY = "triosim.key"  # where the members of a collective, or a send and its receive, meet
A_OP = "triosim.op"
A_LAYER, A_PHASE = "triosim.layer", "triosim.phase"
A_OP_ID, A_MB = "triosim.op_id", "triosim.microbatch"
A_ALGORITHM, A_ROOT = "triosim.algorithm", "triosim.root"
# an uneven all-to-all's bytes per pair (row i: what the group's i-th member sends each),
# row-major in the group's order: its members then post different byte counts
A_SIZES = "triosim.sizes"
# a stream's Signal / Wait: zero-time CPU compute nodes to other readers (ASTRA-sim runs them
# in a nanosecond on the CPU, so they hold neither the GPU's compute nor its communication)
A_SIGNAL, A_WAIT = "triosim.signal", "triosim.wait"
# in a rank file's GlobalMetadata: how many nodes follow (a file cut between two messages is
# still a well-formed stream; this count is how a triosim export's truncation is seen)
A_NODES = "triosim.nodes"

# triosim's collective ops and Chakra's CollectiveCommType
OP_TO_COMM = {
    "allreduce": 0,
    "reduce": 1,
    "all_gather": 2,
    "broadcast": 5,
    "all_to_all": 6,
    "reduce_scatter": 7,
}
COMM_TO_OP = {v: k for k, v in OP_TO_COMM.items()}
COMM_TO_OP[8] = "reduce_scatter"  # REDUCE_SCATTER_BLOCK: equal blocks, as triosim's
COMM_TO_OP[9] = "allreduce"  # BARRIER: an all-reduce of comm_size (normally 0) bytes


def comm_size(op: str, nbytes: float, members: int) -> int:
    """ASTRA-sim's comm_size of a collective triosim sizes as `nbytes` (nccl-tests'
    convention): the same buffer, except an all-gather's, which ASTRA-sim sizes as what
    each rank contributes (it ends with `members` x comm_size)."""
    if op == "all_gather":
        return round(nbytes / members)
    return round(nbytes)


def nbytes_of(op: str, size: int, members: int) -> float:
    """triosim's byte count of a collective whose ASTRA-sim comm_size is `size`."""
    return float(size * members if op == "all_gather" else size)
