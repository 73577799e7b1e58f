"""Join a PyTorch Execution Trace (operators, tensors, parents) with the profiler's Kineto
trace (durations, GPU kernels) into a triosim Trace.

Links, as PyTorch's own trace linker does: ET node `rf_id` = Kineto cpu_op
"Record function id"; a GPU kernel's "External id" = the launching cpu_op's "External
id". Top-level operators are the outermost operator nodes under the phase markers the
collector inserts ("## forward ##", "## optimizer ##"); backward operators are the
autograd engine's "evaluate_function" nodes. The collector also marks parameters,
gradients and optimizer states with `aten::alias` calls under "## mark <category> ##"
so tensor categories come from the model itself, not from guesses.
"""

from __future__ import annotations

from collections import defaultdict

from triosim.errors import TracerError
from triosim.flops import MATH_MODES, math_mode, op_class
from triosim.intervals import union_length
from triosim.trace import Operator, Tensor, Trace

SUPPORTED_SCHEMA_MAJOR = "1."
_BACKWARD = "autograd::engine::evaluate_function"
_SPLIT = ("aten::conv", "aten::linear", "aten::embedding", "aten::matmul", "aten::addmm",
          "aten::mm", "aten::bmm", "aten::_convolution", "aten::convolution")  # fmt: skip
_SPLIT_BWD = ("ConvolutionBackward", "AddmmBackward", "MmBackward", "EmbeddingBackward",
              "BmmBackward", "LinearBackward")  # fmt: skip

DTYPES = {"float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
          "long int": "int64", "int": "int32", "bool": "bool", "unsigned char": "uint8",
          "signed char": "int8", "short int": "int16"}  # fmt: skip


def _attrs(node) -> dict:
    return {a["name"]: a["value"] for a in node.get("attrs", [])}


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith("[pytorch") and not name.startswith("##")


def _tensor_values(vals, types, shapes):
    """Yield (key, shape, dtype, nbytes) of each tensor argument, including tensor lists."""
    for v, t, s in zip(vals, types, shapes, strict=False):
        if isinstance(t, str) and t.startswith("Tensor(") and isinstance(v, list) and len(v) == 6:
            yield (v[0], v[1]), s, t[7:-1], v[3] * v[4]
        elif isinstance(t, str) and t.startswith("GenericList[Tensor") and isinstance(v, list):
            inner = t[len("GenericList[") : -1].split(",")
            for vi, ti, si in zip(v, inner, s if isinstance(s, list) else [], strict=False):
                if isinstance(vi, list) and len(vi) == 6:
                    yield (
                        (vi[0], vi[1]),
                        si,
                        ti[7:-1] if ti.startswith("Tensor(") else "float",
                        vi[3] * vi[4],
                    )


def link(et: dict, kineto: dict, *, gpu: bool, metadata: dict, flops_of=None) -> Trace:
    schema = str(et.get("schema", ""))
    if not schema.startswith(SUPPORTED_SCHEMA_MAJOR):
        raise TracerError(f"Execution Trace schema {schema!r} is not supported (this tracer reads "
                          f"schema {SUPPORTED_SCHEMA_MAJOR}x)")  # fmt: skip
    nodes = {n["id"]: n for n in et.get("nodes", [])}
    if not nodes:
        raise TracerError("the Execution Trace has no nodes (did the profiled iteration run?)")
    # the root names itself as its parent; drop such self-loops so walks up the tree end
    parent = {i: p for i, n in nodes.items() if (p := n.get("ctrl_deps", n.get("parent"))) != i}
    attrs = {i: _attrs(n) for i, n in nodes.items()}

    def ancestors(i):
        p, seen = parent.get(i), {i}
        while p in nodes and p not in seen:
            seen.add(p)
            yield p
            p = parent.get(p)

    # -- tensor categories from the collector's markers ----------------------------------------
    marked: dict[tuple, str] = {}
    for i, n in nodes.items():
        for a in ancestors(i):
            name = nodes[a]["name"]
            if name.startswith("## mark "):
                cat = name[len("## mark ") : -3]
                inp = n["inputs"]
                for key, *_ in _tensor_values(
                    inp["values"], inp.get("types", []), inp.get("shapes", [])
                ):
                    marked.setdefault(key, cat)
                break
    storage_cat = {k[1]: c for k, c in marked.items()}

    # -- top-level operators ----------------------------------------------------------------
    def phase_of(i):
        name = nodes[i]["name"]
        if name.startswith(_BACKWARD):
            return "backward"
        for a in ancestors(i):
            an = nodes[a]["name"]
            if _is_op(an) and not an.startswith("[pytorch"):
                return None  # nested inside another operator
            if an == "## forward ##":
                return "forward"
            if an == "## optimizer ##":
                return "optimizer"
            if an.startswith("## mark ") or an == "## backward ##":
                return None
        return None

    def layer_of(i):
        for a in ancestors(i):
            an = nodes[a]["name"]
            if an.startswith("## module "):
                return an[len("## module ") : -3]
        return ""

    top = []
    for i in sorted(nodes):
        if _is_op(nodes[i]["name"]):
            ph = phase_of(i)
            if ph is not None:
                top.append((i, ph))
    if not top:
        raise TracerError("no operators found under the phase markers of the profiled iteration")
    top_of: dict[int, int] = {i: i for i, _ in top}
    children = defaultdict(list)
    for i, p in parent.items():
        children[p].append(i)

    def subtree(i):
        stack = [i]
        while stack:
            j = stack.pop()
            yield j
            stack.extend(children.get(j, ()))

    for i, _ in top:
        for j in subtree(i):
            top_of[j] = i

    # -- times from Kineto ------------------------------------------------------------------
    events = kineto.get("traceEvents", [])
    by_rf, by_ext = {}, {}
    kernels = defaultdict(list)
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "cpu_op" or e.get("cat") == "user_annotation":
            if "Record function id" in args:
                by_rf[args["Record function id"]] = e
            if "External id" in args:
                by_ext[args["External id"]] = args.get("Record function id")
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[args.get("External id")].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    rf_to_node = {attrs[i].get("rf_id"): i for i in nodes if "rf_id" in attrs[i]}
    op_kernels = defaultdict(list)
    for ext, ivs in kernels.items():
        node = rf_to_node.get(by_ext.get(ext))
        if node is not None and node in top_of:
            op_kernels[top_of[node]].extend(ivs)

    # -- forward/backward pairing by sequence number ------------------------------------------
    fwd_of_seq = {}
    for i, ph in top:
        if ph == "forward":
            for j in subtree(i):
                s = attrs[j].get("seq_id", -1)
                if isinstance(s, int) and s >= 0:
                    fwd_of_seq.setdefault(s, i)

    # -- build operators and tensors --------------------------------------------------------
    tensors: dict[tuple, Tensor] = {}
    ids: dict[tuple, int] = {}

    def tid(key, shape, dtype, nbytes, produced_phase):
        if key not in ids:
            ids[key] = len(ids)
            cat = marked.get(key)
            if cat is None and storage_cat.get(key[1]) in ("weight", "gradient", "optimizer_state"):
                cat = (
                    "buffer"  # a view of a weight/gradient/state: fixed size, not a copy to reduce
                )
            elif cat is None and storage_cat.get(key[1]) == "input":
                cat = "input"
            if cat is None:
                cat = "activation" if produced_phase != "optimizer" else "optimizer_state"
            tensors[key] = Tensor(ids[key], tuple(shape) if isinstance(shape, list) else (),
                                  DTYPES.get(dtype, dtype), float(nbytes), cat)  # fmt: skip
        return ids[key]

    ops = []
    first_forward = True
    for i, ph in top:
        n = nodes[i]
        inp, out = n["inputs"], n["outputs"]
        if ph == "backward":  # evaluate_function carries no tensors; its children do
            ins, outs = [], []
            for j in subtree(i):
                if j == i:
                    continue
                ji, jo = nodes[j]["inputs"], nodes[j]["outputs"]
                ins += list(_tensor_values(ji["values"], ji.get("types", []), ji.get("shapes", [])))
                outs += list(
                    _tensor_values(jo["values"], jo.get("types", []), jo.get("shapes", []))
                )
        else:
            ins = list(_tensor_values(inp["values"], inp.get("types", []), inp.get("shapes", [])))
            outs = list(_tensor_values(out["values"], out.get("types", []), out.get("shapes", [])))
        in_ids = tuple(dict.fromkeys(tid(k, s, d, b, None) for k, s, d, b in ins))
        out_ids = tuple(dict.fromkeys(tid(k, s, d, b, ph) for k, s, d, b in outs))
        if ph == "forward" and first_forward:
            for key in dict.fromkeys(k for k, *_ in ins):  # the model's first inputs: the batch
                if tensors[key].category == "activation":
                    tensors[key].category = "input"
            first_forward = False
        if gpu:
            ivs = op_kernels.get(i, [])
            t = union_length([a for a, _ in ivs], [b for _, b in ivs]) * 1e-6
            k = len(ivs)
        else:
            ev = by_rf.get(attrs[i].get("rf_id"))
            t = (ev.get("dur", 0.0) if ev else 0.0) * 1e-6
            k = max(1, sum(1 for j in subtree(i) if not children.get(j)))
        name = n["name"]
        fwd_id = None
        layer = layer_of(i) if ph != "optimizer" else "optimizer"
        if ph == "backward":
            seqs = [attrs[j].get("seq_id", -1) for j in subtree(i)]
            fwd = next((fwd_of_seq[s] for s in seqs if s in fwd_of_seq), None)
            if fwd is not None:
                fwd_id = fwd
                layer = layer_of(fwd)
        split = (ph == "forward" and name.startswith(_SPLIT)) or (
            ph == "backward" and any(s in name for s in _SPLIT_BWD)
        )
        flops = None
        if flops_of is not None:
            flops = flops_of(nodes, i, subtree, children)
        ops.append(
            Operator(i, name, layer, ph, t, in_ids, out_ids, flops, fwd_id, max(k, 1), split)
        )
    # a forward op in the root module's own forward, outside every submodule
    for op in ops:
        if op.phase == "forward" and not op.layer:
            op.layer = "(model)"
    table = {t.id: t for t in tensors.values()}
    set_math(ops, table, cuda=gpu, cudnn_tf32=metadata.get("cudnn_allow_tf32", True),
             matmul_tf32=metadata.get("matmul_allow_tf32", False))  # fmt: skip
    return Trace(ops, table, metadata).validate()


def set_math(ops, tensors, *, cuda: bool, cudnn_tf32: bool = True, matmul_tf32: bool = False):
    """Each op's math mode: the dtype of its largest floating-point tensor, TF32 for float32
    convolutions and matrix products on CUDA where the recorded settings allow it."""
    for op in ops:
        ts = [tensors[t] for t in op.inputs + op.outputs if tensors[t].dtype in MATH_MODES]
        if ts:
            dtype = max(ts, key=lambda t: t.nbytes).dtype
            op.math = math_mode(op_class(op.name), dtype, cuda=cuda, cudnn_tf32=cudnn_tf32,
                                matmul_tf32=matmul_tf32)  # fmt: skip


def node_flops(nodes, i, subtree, children) -> float | None:
    """FLOPs of a top-level op: the sum over its outermost sub-ops that PyTorch's
    flop counter knows (torch.utils.flop_counter's formulas, fed the recorded shapes)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    total, known = 0.0, False
    stack = [i]
    while stack:
        j = stack.pop()
        name = nodes[j]["name"]
        packet = None
        if name.startswith("aten::"):
            packet = getattr(torch.ops.aten, name[6:].split(".")[0], None)
        if packet is not None and packet in flop_registry:
            inp, out = nodes[j]["inputs"], nodes[j]["outputs"]
            args = [s if isinstance(t, str) and t.startswith("Tensor") else
                    (None if v == "<None>" else v)
                    for v, t, s in zip(inp["values"], inp.get("types", []), inp.get("shapes", []),
                                       strict=False)]  # fmt: skip
            out_shapes = out.get("shapes", [])
            out_val = out_shapes[0] if len(out_shapes) == 1 else tuple(out_shapes)
            # formulas differ in how many trailing scalars they take (addmm's beta/alpha
            # are not in its formula): try all arguments, then fewer
            for n_args in range(len(args), 0, -1):
                try:
                    total += float(flop_registry[packet](*args[:n_args], out_val=out_val))
                    known = True
                    break
                except Exception:  # noqa: BLE001 - a formula that needs more than shapes
                    continue
            continue  # outermost counted op: do not count its children again
        stack.extend(children.get(j, ()))
    return total if known else None
