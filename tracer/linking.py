"""Join a PyTorch Execution Trace (operators, tensors, parents) with the profiler's Kineto
trace (durations, GPU kernels) into a triosim Trace.

Links, as PyTorch's own trace linker does: ET node `rf_id` = Kineto cpu_op
"Record function id"; a GPU kernel's "External id" = the launching cpu_op's "External
id". Top-level operators are the outermost operator nodes under the phase markers the
collector inserts ("## forward ##", "## optimizer ##"); backward operators are the
autograd engine's "evaluate_function" nodes. The collector also marks parameters,
gradients and optimizer states with `aten::alias` calls under "## mark <category> ##"
so tensor categories come from the model itself, not from guesses.

`link`'s steps, in order: `_check_et`, tracer.et_storage.alias_storage (views share a
storage id), `_marked_tensors` (the markers' categories and names), `_top_level` (the
operators and their phases), `_KinetoTimes` (their times), `_forward_of_seq` (backward to
forward pairing), `_operators` (one Operator each, tensors numbered by `_Tensors`), then
passes over the operators that complete categories, layers, FLOPs and math modes. Reading
the ET's nodes: tracer.et_nodes; a shape-only run's ET is first made to read like a real
one by tracer.meta_trace; PyTorch's FLOP counter: tracer.torch_flops.
"""

from __future__ import annotations

from collections import defaultdict

from tracer.et_nodes import EtTree, is_op, side_values
from tracer.et_storage import alias_storage
from tracer.host_times import HostTimes
from triosim.common.errors import TracerError
from triosim.common.intervals import union_length
from triosim.trace.flops import (
    MATH_MODES,
    backward_flops,
    forward_flops,
    math_mode,
    numel,
    op_class,
)
from triosim.trace.model import Operator, Tensor, Trace

SUPPORTED_SCHEMA_MAJOR = "1."
_BACKWARD = "autograd::engine::evaluate_function"
_SPLIT = (
    "aten::conv",
    "aten::linear",
    "aten::embedding",
    "aten::matmul",
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::_convolution",
    "aten::convolution",
)
_SPLIT_BWD = (
    "ConvolutionBackward",
    "AddmmBackward",
    "MmBackward",
    "EmbeddingBackward",
    "BmmBackward",
    "LinearBackward",
)

DTYPES = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "int": "int32",
    "bool": "bool",
    "unsigned char": "uint8",
    "signed char": "int8",
    "short int": "int16",
}


def link(
    et: dict,
    kineto: dict,
    *,
    gpu: bool,
    metadata: dict,
    flops_of=None,
    cuda_math: bool | None = None,
) -> Trace:
    """The triosim Trace of one profiled iteration. gpu: times are the union of each
    operator's GPU kernels (else its CPU duration); cuda_math: math modes as on CUDA
    (default: gpu). flops_of(nodes, i, subtree, children): an operator's FLOPs, or None;
    those it does not know come from triosim.trace.flops's shape formulas."""
    _check_et(et)
    alias_storage(et["nodes"])  # rewrites the ET's storage ids in place
    tree = EtTree(et["nodes"])
    marked, names = _marked_tensors(tree)
    top = _top_level(tree)
    times = _KinetoTimes(kineto, tree, top)
    tensors = _Tensors(marked, names)
    ops = _operators(tree, top, tensors, times, _forward_of_seq(tree, top), gpu, flops_of)
    # a forward op in the root module's own forward, outside every submodule
    for op in ops:
        if op.phase == "forward" and not op.layer:
            op.layer = "(model)"
    table = tensors.table()
    _fixed_size_outputs(ops, table)
    _gradient_layers(ops, table)
    _shape_flops(ops, table)
    set_math(
        ops,
        table,
        cuda=gpu if cuda_math is None else cuda_math,
        cudnn_tf32=metadata.get("cudnn_allow_tf32", True),
        matmul_tf32=metadata.get("matmul_allow_tf32", False),
    )
    return Trace(ops, table, metadata).validate()


def _check_et(et: dict) -> None:
    """TracerError unless the ET has a supported schema and nodes."""
    schema = str(et.get("schema", ""))
    if not schema.startswith(SUPPORTED_SCHEMA_MAJOR):
        raise TracerError(
            f"Execution Trace schema {schema!r} is not supported (this tracer reads "
            f"schema {SUPPORTED_SCHEMA_MAJOR}x)"
        )
    if not et.get("nodes"):
        raise TracerError("the Execution Trace has no nodes (did the profiled iteration run?)")


def _marked_tensors(tree: EtTree) -> tuple[dict[tuple, str], dict[tuple, str]]:
    """(category, name) by tensor key ((ET id, storage id)), from the collector's markers:
    the tensors an operator under "## mark <category> <name> ##" reads (older tracers:
    "## mark <category> ##", no name). The innermost marker around an operator counts; a
    tensor's first marking wins."""
    marked: dict[tuple, str] = {}
    names: dict[tuple, str] = {}
    for i, n in tree.nodes.items():
        for a in tree.ancestors(i):
            name = tree.nodes[a]["name"]
            if name.startswith("## mark "):
                cat, _, tname = name[len("## mark ") : -3].partition(" ")
                for key, *_ in side_values(n["inputs"]):
                    marked.setdefault(key, cat)
                    if tname:
                        names.setdefault(key, tname)
                break
    return marked, names


def _phase(tree: EtTree, i: int) -> str | None:
    """The phase of a top-level operator ("forward", "backward", "optimizer"), or None for
    a node nested in another operator, under a marker, or under no phase range."""
    name = tree.nodes[i]["name"]
    if name.startswith(_BACKWARD):
        return "backward"
    for a in tree.ancestors(i):
        an = tree.nodes[a]["name"]
        if is_op(an) and not an.startswith("[pytorch"):
            return None  # nested inside another operator
        if an == "## forward ##":
            return "forward"
        if an == "## optimizer ##":
            return "optimizer"
        if an.startswith("## mark ") or an == "## backward ##":
            return None
    return None


def _layer(tree: EtTree, i: int) -> str:
    """The innermost "## module <path> ##" range around node i ("" for none)."""
    for a in tree.ancestors(i):
        an = tree.nodes[a]["name"]
        if an.startswith("## module "):
            return an[len("## module ") : -3]
    return ""


def _top_level(tree: EtTree) -> list[tuple[int, str]]:
    """(node id, phase) of each top-level operator, in id (execution) order; TracerError if
    there is none."""
    top = []
    for i in sorted(tree.nodes):
        if is_op(tree.nodes[i]["name"]):
            ph = _phase(tree, i)
            if ph is not None:
                top.append((i, ph))
    if not top:
        raise TracerError("no operators found under the phase markers of the profiled iteration")
    return top


class _KinetoTimes:
    """Each top-level operator's time from the Kineto trace: `of(i, gpu)` -> (seconds,
    kernels), and `host.of(i, gpu)` its host columns (tracer.host_times). On a GPU, the
    union of the kernels (and memcpy, memset) that the operator's subtree launched (a kernel's External id is its launching cpu_op's); on CPU, the
    operator's cpu_op duration (matched by Record function id = the ET's rf_id), and the
    leaves of its subtree as kernels. Assumes `top` lists every top-level operator."""

    def __init__(self, kineto: dict, tree: EtTree, top: list):
        self.tree = tree
        top_of: dict[int, int] = {i: i for i, _ in top}
        for i, _ in top:
            for j in tree.subtree(i):
                top_of[j] = i
        self.by_rf, by_ext = {}, {}
        kernels = defaultdict(list)
        for e in kineto.get("traceEvents", []):
            args = e.get("args", {})
            if e.get("cat") == "cpu_op" or e.get("cat") == "user_annotation":
                if "Record function id" in args:
                    self.by_rf[args["Record function id"]] = e
                if "External id" in args:
                    by_ext[args["External id"]] = args.get("Record function id")
            elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                kernels[args.get("External id")].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
        attrs = tree.attrs
        rf_to_node = {attrs[i].get("rf_id"): i for i in tree.nodes if "rf_id" in attrs[i]}
        self.op_kernels = defaultdict(list)
        for ext, ivs in kernels.items():
            node = rf_to_node.get(by_ext.get(ext))
            if node is not None and node in top_of:
                self.op_kernels[top_of[node]].extend(ivs)
        self.host = HostTimes(kineto, tree, top_of, self.by_rf, by_ext)

    def of(self, i: int, gpu: bool) -> tuple[float, int]:
        if gpu:
            ivs = self.op_kernels.get(i, [])
            return union_length([a for a, _ in ivs], [b for _, b in ivs]) * 1e-6, len(ivs)
        tree = self.tree
        ev = self.by_rf.get(tree.attrs[i].get("rf_id"))
        t = (ev.get("dur", 0.0) if ev else 0.0) * 1e-6
        return t, max(1, sum(1 for j in tree.subtree(i) if not tree.children.get(j)))


def _forward_of_seq(tree: EtTree, top: list) -> dict[int, int]:
    """Autograd sequence number -> the forward operator that owns it, for pairing backward
    operators with their forward ones.

    An operator records the autograd sequence counter as it stands; only one that creates
    an autograd node advances it. Operators that create none (a batch norm's
    num_batches_tracked += 1, under no_grad) record the number the next node will take, so
    the number belongs to the last forward operator that recorded it."""
    fwd_of_seq = {}
    for i, ph in top:
        if ph == "forward":
            for j in tree.subtree(i):
                s = tree.attrs[j].get("seq_id", -1)
                if isinstance(s, int) and s >= 0:
                    fwd_of_seq[s] = i
    return fwd_of_seq


class _Tensors:
    """The linked trace's tensors, numbered 0, 1, ... as first seen: `tid(key, shape, dtype,
    nbytes, produced_phase)` gives a tensor key's id, making its Tensor the first time
    (category from the markers, else from what its storage holds, else from the phase that
    made it; storages numbered 0, 1, ... by the ET's storage id); `table()` the id -> Tensor
    map. The Tensors are shared: a change to one (`mark_batch`) shows in the table."""

    def __init__(self, marked: dict, names: dict):
        self.marked, self.names = marked, names
        self.storage_cat = {k[1]: c for k, c in marked.items()}
        self.by_key: dict[tuple, Tensor] = {}
        self.ids: dict[tuple, int] = {}
        self.storages: dict = {}  # the ET's (view-aliased) storage id -> a small number

    def tid(self, key, shape, dtype, nbytes, produced_phase) -> int:
        ids = self.ids
        if key not in ids:
            ids[key] = len(ids)
            cat = self.marked.get(key)
            held = self.storage_cat.get(key[1])
            if cat is None and held in ("weight", "gradient", "optimizer_state"):
                # a view of a weight/gradient/state: fixed size, not a copy to reduce
                cat = "buffer"
            elif cat is None and held == "input":
                cat = "input"
            if cat is None:
                cat = "activation" if produced_phase != "optimizer" else "optimizer_state"
            self.by_key[key] = Tensor(
                ids[key],
                tuple(shape) if isinstance(shape, list) else (),
                DTYPES.get(dtype, dtype),
                float(nbytes),
                cat,
                self.names.get(key),
                self.storages.setdefault(key[1], len(self.storages)),
            )
        return ids[key]

    def mark_batch(self, keys) -> None:
        """The model's first inputs are the batch: activations among `keys` become inputs."""
        for key in dict.fromkeys(keys):
            if self.by_key[key].category == "activation":
                self.by_key[key].category = "input"

    def table(self) -> dict[int, Tensor]:
        return {t.id: t for t in self.by_key.values()}


def _operators(tree, top, tensors: _Tensors, times, fwd_of_seq, gpu, flops_of) -> list[Operator]:
    """One Operator per top-level operator (`top`, in order), its tensors numbered through
    `tensors` (inputs first, so an in-place op's tensor keeps its input's category); the
    first forward operator's inputs are the batch."""
    ops = []
    first_forward = True
    for i, ph in top:
        ins, outs = _op_tensor_values(tree, i, ph)
        in_ids = tuple(dict.fromkeys(tensors.tid(k, s, d, b, None) for k, s, d, b in ins))
        out_ids = tuple(dict.fromkeys(tensors.tid(k, s, d, b, ph) for k, s, d, b in outs))
        if ph == "forward" and first_forward:
            tensors.mark_batch(k for k, *_ in ins)
            first_forward = False
        t, k = times.of(i, gpu)
        name = tree.nodes[i]["name"]
        layer, fwd_id = _layer_and_forward(tree, i, ph, fwd_of_seq)
        split = (ph == "forward" and name.startswith(_SPLIT)) or (
            ph == "backward" and any(s in name for s in _SPLIT_BWD)
        )
        flops = None
        if flops_of is not None:
            flops = flops_of(tree.nodes, i, tree.subtree, tree.children)
        # on a GPU, k is what the operator launched: 0 for one that ran on the host alone
        op = Operator(i, name, layer, ph, t, in_ids, out_ids, flops, fwd_id, k, split)
        for f, v in times.host.of(i, gpu).items():
            setattr(op, f, v)
        ops.append(op)
    return ops


def _op_tensor_values(tree: EtTree, i: int, ph: str) -> tuple[list, list]:
    """(inputs, outputs) of top-level operator i as `tensor_values` tuples; a backward
    operator's (evaluate_function carries no tensors) are its children's, in subtree order."""
    n = tree.nodes[i]
    inp, out = n["inputs"], n["outputs"]
    if ph != "backward":
        return side_values(inp), side_values(out)
    ins, outs = [], []
    for j in tree.subtree(i):
        if j == i:
            continue
        ins += side_values(tree.nodes[j]["inputs"])
        outs += side_values(tree.nodes[j]["outputs"])
    return ins, outs


def _layer_and_forward(tree: EtTree, i: int, ph: str, fwd_of_seq: dict) -> tuple[str, int | None]:
    """(layer, forward operator id or None) of top-level operator i: the module around it
    ("optimizer" for the optimizer's); a backward operator takes the forward operator of the
    first sequence number in its subtree that one owns, and that operator's module."""
    fwd_id = None
    layer = _layer(tree, i) if ph != "optimizer" else "optimizer"
    if ph == "backward":
        seqs = [tree.attrs[j].get("seq_id", -1) for j in tree.subtree(i)]
        fwd = next((fwd_of_seq[s] for s in seqs if s in fwd_of_seq), None)
        if fwd is not None:
            fwd_id = fwd
            layer = _layer(tree, fwd)
    return layer, fwd_id


def _fixed_size_outputs(ops, tensors) -> None:
    """A forward op that reads tensors and none of them grows with the batch (a weight cast
    to bfloat16, a slice of a rotary table) makes a tensor of fixed size: a buffer, not an
    activation. Factories with no tensor input keep "activation" (they may be batch-sized)."""
    for op in ops:
        if op.phase != "forward" or not op.inputs:
            continue
        if any(tensors[t].scales_with_batch for t in op.inputs):
            continue
        src = [tensors[t] for t in op.inputs if tensors[t].category == "weight"]
        for t in op.outputs:
            out = tensors[t]
            if t in op.inputs:
                continue
            if out.category == "activation":
                out.category = "buffer"
            # a weight cast for mixed precision: "<parameter>.bfloat16"
            if (
                out.category == "buffer"
                and len(src) == 1
                and src[0].name
                and not out.name
                and out.shape == src[0].shape
                and out.dtype != src[0].dtype
            ):
                out.name = f"{src[0].name}.{out.dtype}"


def _gradient_layers(ops, tensors) -> None:
    """AccumulateGrad has no forward op to take a layer from: it takes the module that owns
    the parameter whose gradient it stores (from the gradient's name)."""
    for op in ops:
        if op.phase == "backward" and not op.layer and op.name.endswith("AccumulateGrad"):
            for t in op.outputs:
                g = tensors[t]
                if g.category == "gradient" and g.name:
                    op.layer = g.name.rpartition(".")[0] or "(model)"
                    break


def _shape_flops(ops, tensors) -> None:
    """FLOPs for the operators PyTorch's flop counter does not know (element-wise,
    normalisation, pooling, loss, optimizer): triosim.trace.flops's formulas on the recorded
    shapes, as the TrioSim CSV importer computes them; a backward op's from its forward op."""
    by_id = {o.id: o for o in ops}
    for op in ops:
        if op.flops is None and op.phase != "backward":
            op.flops = forward_flops(
                op.name,
                [tensors[t].shape for t in op.inputs],
                [tensors[t].shape for t in op.outputs],
            )
    for op in ops:
        if op.flops is not None or op.phase != "backward":
            continue
        f = by_id.get(op.fwd_id)
        if f is not None and f.inputs:
            x = tensors[f.inputs[0]]
            op.flops = backward_flops(
                op.name, f.flops, numel(x.shape), input_grad=x.category != "input"
            )
        elif op.outputs:
            op.flops = backward_flops(op.name, None, numel(tensors[op.outputs[0]].shape))


def set_math(ops, tensors, *, cuda: bool, cudnn_tf32: bool = True, matmul_tf32: bool = False):
    """Each op's math mode: the dtype of its largest floating-point tensor, TF32 for float32
    convolutions and matrix products on CUDA where the recorded settings allow it."""
    for op in ops:
        ts = [tensors[t] for t in op.inputs + op.outputs if tensors[t].dtype in MATH_MODES]
        if ts:
            dtype = max(ts, key=lambda t: t.nbytes).dtype
            op.math = math_mode(
                op_class(op.name), dtype, cuda=cuda, cudnn_tf32=cudnn_tf32, matmul_tf32=matmul_tf32
            )
