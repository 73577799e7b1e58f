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

import copy
import difflib
import re
from collections import defaultdict

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
    schema = str(et.get("schema", ""))
    if not schema.startswith(SUPPORTED_SCHEMA_MAJOR):
        raise TracerError(
            f"Execution Trace schema {schema!r} is not supported (this tracer reads "
            f"schema {SUPPORTED_SCHEMA_MAJOR}x)"
        )
    if not et.get("nodes"):
        raise TracerError("the Execution Trace has no nodes (did the profiled iteration run?)")
    alias_storage(et["nodes"])  # rewrites the ET's storage ids in place
    nodes = {n["id"]: n for n in et["nodes"]}
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
    names: dict[tuple, str] = {}
    for i, n in nodes.items():
        for a in ancestors(i):
            name = nodes[a]["name"]
            if name.startswith("## mark "):
                # "## mark <category> <name> ##" (older tracers: "## mark <category> ##")
                cat, _, tname = name[len("## mark ") : -3].partition(" ")
                inp = n["inputs"]
                for key, *_ in _tensor_values(
                    inp["values"], inp.get("types", []), inp.get("shapes", [])
                ):
                    marked.setdefault(key, cat)
                    if tname:
                        names.setdefault(key, tname)
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
    # An operator records the autograd sequence counter as it stands; only one that creates
    # an autograd node advances it. Operators that create none (a batch norm's
    # num_batches_tracked += 1, under no_grad) record the number the next node will take, so
    # the number belongs to the last forward operator that recorded it.
    fwd_of_seq = {}
    for i, ph in top:
        if ph == "forward":
            for j in subtree(i):
                s = attrs[j].get("seq_id", -1)
                if isinstance(s, int) and s >= 0:
                    fwd_of_seq[s] = i

    # -- build operators and tensors --------------------------------------------------------
    tensors: dict[tuple, Tensor] = {}
    ids: dict[tuple, int] = {}
    storages: dict = {}  # the ET's (view-aliased) storage id -> a small number

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
            tensors[key] = Tensor(
                ids[key],
                tuple(shape) if isinstance(shape, list) else (),
                DTYPES.get(dtype, dtype),
                float(nbytes),
                cat,
                names.get(key),
                storages.setdefault(key[1], len(storages)),
            )
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


def _sdpa_flops(args, backward: bool) -> float | None:
    """PyTorch's attention FLOP formulas (torch.utils.flop_counter) for the CPU flash kernel,
    which its registry lacks; grouped-query key/value heads count as the query's."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shapes = [a for a in args if isinstance(a, list) and len(a) == 4]
    if backward:
        if len(shapes) < 4:
            return None
        g, q, k, v = shapes[:4]
        k, v = [q[0], q[1], *k[2:]], [q[0], q[1], *v[2:]]
        return float(sdpa_backward_flop_count(g, q, k, v))
    if len(shapes) < 3:
        return None
    q, k, v = shapes[:3]
    k, v = [q[0], q[1], *k[2:]], [q[0], q[1], *v[2:]]
    return float(sdpa_flop_count(q, k, v))


_EXTRA_FLOPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": False,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": True,
}


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
        if name in _EXTRA_FLOPS:
            inp = nodes[j]["inputs"]
            f = _sdpa_flops(inp.get("shapes", []), _EXTRA_FLOPS[name])
            if f is not None:
                total += f
                known = True
                continue
        if name.startswith("aten::"):
            packet = getattr(torch.ops.aten, name[6:].split(".")[0], None)
        if packet is not None and packet in flop_registry:
            inp, out = nodes[j]["inputs"], nodes[j]["outputs"]
            args = [
                s
                if isinstance(t, str) and t.startswith("Tensor")
                else (None if v == "<None>" else v)
                for v, t, s in zip(
                    inp["values"], inp.get("types", []), inp.get("shapes", []), strict=False
                )
            ]
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


_DISPATCH_MODE = "PythonDispatchMode"
_STAND_INS = {"aten::scaled_dot_product_attention"}  # collect._cpu_attention's range
_STORAGE_BASE = 1 << 40  # synthetic storage ids: far from any id the ET hands out


def prepare_meta_trace(et: dict, numbers: list, storages: dict | None = None) -> dict:
    """The Execution Trace of a shape-only run (meta tensors, under collect's tagging
    dispatch mode), made to read like a real one:

    - drop what ran below the dispatch mode (the "PythonDispatchMode" node under each
      operator that reached the mode, and everything under it: meta kernels, some written
      in Python, which a CPU or GPU run does not have); splice out the mode's nodes around
      record_function ranges;
    - name tensors by the mode's numbers (`numbers`: per mode call in order, the numbers of
      the tensors it read and returned): an ET tensor id is a TensorImpl address, reused
      once a tensor is freed, and meta tensors have no data pointer to tell them apart;
    - drop the detach autograd issues, under the mode only, when it saves a tensor;
    - give the numbered tensors the mode's storage (`storages`: number -> the address of
      its StorageImpl), so a saved tensor unpacked in backward meets its forward tensor.

    Storage ids (which views share) come next, from the operator schemas, in `link`.
    """
    nodes = et.get("nodes", [])
    by_id = {n["id"]: n for n in nodes}
    parent = {n["id"]: n.get("ctrl_deps", n.get("parent")) for n in nodes}

    def mode_under_op(i):
        """A mode node of an operator (drop what is below it), not of a record_function
        range entering (a String argument) or leaving (an Object) through the mode."""
        n = by_id[i]
        types = n.get("inputs", {}).get("types") or [""]
        return n["name"] == _DISPATCH_MODE and types[0] not in ("String", "Object")

    def call_label(name):
        ns, _, rest = name.partition(".")
        return "profiler" if ns == "profiler" else f"{ns}::{rest.split('.')[0]}"

    drop: dict[int, bool] = {}

    def dropped(i):
        chain, verdict = [], False
        while True:
            if i in drop:
                verdict = drop[i]
                break
            if i not in by_id:
                break
            chain.append(i)
            if mode_under_op(i):
                verdict = True
                break
            p = parent.get(i)
            if p is None or p == i:
                break
            i = p
        for j in chain:
            drop[j] = verdict
        return verdict

    def saved_detach(i):
        """A detach the dispatch mode makes autograd issue when it saves or unpacks a
        tensor for backward, inside an operator or autograd node: a run without the mode has
        none (AccumulateGrad's own detach, which steals a gradient, is real)."""
        n = by_id[i]
        p = by_id.get(parent[i], {}).get("name", "")
        inside = not p.startswith(("##", "ProfilerStep")) and "AccumulateGrad" not in p
        return n["name"] == "aten::detach" and inside

    same_as: dict[int, int] = {}  # a saved-tensor detach's output ET id -> its input's
    for i in sorted(by_id):
        if saved_detach(i):
            ins, outs = _tensor_items(by_id[i]["inputs"]), _tensor_items(by_id[i]["outputs"])
            if len(ins) == 1 and len(outs) == 1:
                same_as[outs[0][0]] = ins[0][0]
                drop[i] = True

    kept = []
    for n in nodes:
        if dropped(n["id"]) or n["name"] == _DISPATCH_MODE:
            continue  # below an operator, or a record_function passing through the mode
        p = parent.get(n["id"])
        while p in by_id and by_id[p]["name"] == _DISPATCH_MODE and p != parent.get(p):
            p = parent.get(p)
        kept.append({**n, "ctrl_deps": p} if "ctrl_deps" in n else {**n, "parent": p})

    # -- a range standing in for a composite operator (collect._cpu_attention) has its
    # inputs; its output is its operator's first
    kids: dict[int, list] = defaultdict(list)
    for n in kept:
        kids[n.get("ctrl_deps", n.get("parent"))].append(n)
    for n in kept:
        if n["name"] in _STAND_INS and not n.get("outputs", {}).get("values"):
            inner = [c for c in kids.get(n["id"], []) if _is_op(c["name"])]
            if inner and inner[0].get("outputs", {}).get("values"):
                o = inner[0]["outputs"]
                n["outputs"] = {
                    k: copy.deepcopy(o[k][:1])
                    for k in ("values", "shapes", "types", "strides")
                    if o.get(k)
                }

    # -- the mode's calls are, in order, the operators that reached it (and the
    # record_function ranges passing through it); align them with the ET's operators by
    # name: composite operators (aten::linear) never reach the mode, and a few operators
    # (the detach AccumulateGrad makes) reach it without leaving a mode node to count on
    seq = [
        (i, by_id[i]["name"])
        for i in sorted(by_id)
        if (not dropped(i) and _is_op(by_id[i]["name"]))
        or (by_id[i]["name"] == _DISPATCH_MODE and not mode_under_op(i))
    ]
    matcher = difflib.SequenceMatcher(
        None,
        [name if name != _DISPATCH_MODE else "profiler" for _, name in seq],
        [call_label(c[2]) for c in numbers],
        autojunk=False,
    )
    named: dict[int, tuple[list, list]] = {}  # op node -> (input numbers, output numbers)
    for blk in matcher.get_matching_blocks():
        for k in range(blk.size):
            named[seq[blk.a + k][0]] = numbers[blk.b + k][:2]

    # -- rename tensors: the mode's number where known, in time order --------------------------
    kept_ids = {n["id"] for n in kept}
    kparent = {n["id"]: n.get("ctrl_deps", n.get("parent")) for n in kept}
    last = {i: i for i in kept_ids}  # the last node of each subtree, by id
    for i in sorted(kept_ids, reverse=True):
        p = kparent.get(i)
        if p in last and p != i:
            last[p] = max(last[p], last[i])
    events = []
    for n in kept:
        events.append((n["id"], 0, n, "inputs"))
        events.append((last[n["id"]], 1, n, "outputs"))  # outputs exist once the subtree ran
    events.sort(key=lambda e: (e[0], e[1]))
    current: dict[int, int] = {}  # ET tensor id -> number of the tensor it names now
    fresh = iter(range(_STORAGE_BASE, 2 * _STORAGE_BASE))

    def rename(side, nums):
        # the mode's numbers go to the tensors it was handed, in order: not an undefined
        # tensor nor a wrapped number (`_unseen_by_mode`). A tensor left without one is named
        # by its ET id, the address of its TensorImpl, which PyTorch reuses once a tensor is
        # freed: a tensor the mode numbered must never be named so (it took a freed
        # tensor's number, and storage, wherever the allocator had put it: a weight's view
        # made attention's saved output a "buffer" in some runs), and a wrapped number is
        # made anew for each call
        items = _tensor_items(side)
        unseen = _unseen_by_mode(side) if nums is not None else {}
        handed = [x for x in items if id(x) not in unseen]
        if nums is not None and len(nums) != len(handed):  # a number in a tensor's place?
            handed = [x for x in items if unseen.get(id(x)) != "undefined"]
            unseen = {k: v for k, v in unseen.items() if v == "undefined"}
        if nums is not None and len(nums) == len(handed):
            for x, k in zip(handed, nums, strict=True):
                current[x[0]] = k
            for x in items:
                if unseen.get(id(x)) == "wrapped":
                    current[x[0]] = next(fresh)
        for x in items:
            if x[0] not in current:
                src = same_as.get(x[0])
                current[x[0]] = current[src] if src in current else next(fresh)
            x[0] = current[x[0]]
            if storages and x[0] in storages:
                x[1] = storages[x[0]]

    for _, kind, n, side in events:
        nums = named.get(n["id"])
        rename(n.get(side, {}), None if nums is None else nums[kind])

    return {**et, "nodes": kept}


def alias_storage(nodes: list) -> bool:
    """Rewrite each tensor's storage id (in place) so that a view shares its base's storage
    and every other tensor has its own: an output whose schema alias set is an input's (e.g.
    `aten::t(Tensor(a) self) -> Tensor(a)`, `aten::add_(Tensor(a!) self, ...)`) joins that
    input's storage. The ET's own storage id is a data pointer, which the allocator hands to
    a new tensor once the old one is freed (an activation freed in backward and a gradient
    allocated in its place would share it), and which meta tensors do not have. Returns
    False, changing nothing, for an ET without operator schemas."""
    if not any(_attrs(n).get("op_schema") for n in nodes):
        return False
    root: dict[tuple, tuple] = {}

    def find(k):
        while root.get(k, k) != k:
            k = root[k]
        return k

    def keys(side):  # per argument, the (id, storage) of its tensors
        return [[(x[0], x[1]) for x in items] for items in _tensor_args(side)]

    schemas: dict[str, tuple] = {}
    ordered = sorted(nodes, key=lambda n: n["id"])  # execution order
    for n in ordered:
        text = _attrs(n).get("op_schema")
        if not text:
            continue
        if text not in schemas:
            schemas[text] = _alias_sets(text)
        arg_sets, ret_sets = schemas[text]
        alias_in = {}
        for aset, ks in zip(arg_sets, keys(n["inputs"]), strict=False):
            if aset and ks:
                alias_in.setdefault(aset, ks[0])
        for rset, ks in zip(ret_sets, keys(n.get("outputs", {})), strict=False):
            base = alias_in.get(rset) if rset else None
            if base is not None:
                for k in ks:
                    rk, rb = find(k), find(base)
                    if rk != rb:
                        root[rk] = rb
    # a tensor first seen as an input whose ET storage is one seen before is a new handle
    # on memory that is still alive (autograd unpacking a saved tensor for backward: a new
    # tensor id, the forward tensor's storage): it joins the latest tensor seen there. An
    # output never does so: a new output at a used pointer is new memory, reused. Nor does
    # the input of aten::lift_fresh: a constant just made from Python data (an optimizer's
    # scalar), which the allocator may place where a freed tensor was (its category then
    # varied from run to run with the allocator's state)
    latest: dict = {}
    seen: set = set()
    for n in ordered:
        fresh = n.get("name") == "aten::lift_fresh"
        for side, is_input in ((n["inputs"], True), (n.get("outputs", {}), False)):
            for x in _tensor_items(side):
                k, raw = (x[0], x[1]), x[1]
                if not raw:
                    continue  # a tensor without storage
                if is_input and not fresh and k not in seen and raw in latest and latest[raw] != k:
                    a, b = find(k), find(latest[raw])
                    if a != b:
                        root[a] = b
                seen.add(k)
                latest[raw] = k
    storage: dict[tuple, int] = {}
    for n in nodes:
        for side in (n["inputs"], n.get("outputs", {})):
            for x in _tensor_items(side):
                x[1] = storage.setdefault(find((x[0], x[1])), _STORAGE_BASE + len(storage))
    return True


def _tensor_args(side) -> list[list]:
    """Per argument of an ET node's inputs or outputs, its 6-element tensor values (several
    for a tensor list, none for a non-tensor), to be read or edited in place."""
    out = []
    for v, t in zip(side.get("values", []), side.get("types", []), strict=False):
        if isinstance(t, str) and t.startswith("Tensor(") and isinstance(v, list) and len(v) == 6:
            out.append([v])
        elif isinstance(t, str) and t.startswith("GenericList[") and isinstance(v, list):
            out.append([x for x in v if isinstance(x, list) and len(x) == 6])
        else:
            out.append([])
    return out


def _unseen_by_mode(side) -> dict:
    """The tensor values (by id()) of an ET node's inputs or outputs that a dispatch mode is
    not handed as tensors: "undefined", an absent optional tensor (attn_mask=None), which
    the autograd-level call records as a tensor with no storage and no device; "wrapped",
    a 0-dim CPU float64 or int64 tensor, maybe a wrapped number (a Python scalar where the
    schema takes a tensor: `step += 1` is aten::add_.Tensor), which the mode gets back as
    the Python number."""
    out = {}
    for items, t, s in zip(
        _tensor_args(side), side.get("types", []), side.get("shapes", []), strict=False
    ):
        for x in items:
            if not x[1] and not x[5]:
                out[id(x)] = "undefined"
            elif (
                t in ("Tensor(double)", "Tensor(long int)")
                and s == []
                and x[5] == "cpu"
                and x[3] == 1
            ):
                out[id(x)] = "wrapped"
    return out


def _tensor_items(side):
    """The 6-element tensor values of an ET node's inputs or outputs, lists flattened."""
    return [x for items in _tensor_args(side) for x in items]


_ALIAS = re.compile(r"^Tensor\((\w+)!?(?: -> \*)?\)")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets and parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _alias_sets(schema: str) -> tuple[list, list]:
    """The alias set of each argument and each return of an operator schema ("a" for
    `Tensor(a) self`, `Tensor(a!) self`, `Tensor(a)[]`; None for no alias)."""
    try:
        head, ret = schema.rsplit("->", 1)
        args = head[head.index("(") + 1 : head.rindex(")")]
    except ValueError:
        return [], []
    ret = ret.strip()
    if ret.startswith("(") and ret.endswith(")"):
        ret = ret[1:-1]

    def sets(parts):
        out = []
        for p in parts:
            m = _ALIAS.match(p.strip())
            out.append(m.group(1) if m else None)
        return out

    return sets(a for a in _split_top(args) if a != "*"), sets(_split_top(ret))
