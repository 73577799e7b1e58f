"""A shape-only run's Execution Trace, made to read like a real one (`prepare_meta_trace`).

tracer.collect records a shape-only iteration on meta tensors under a tagging dispatch mode
(tracer.meta_run.tagging_mode), which numbers every tensor an operator reads or returns. This module
takes that ET and the mode's numbers and returns an ET that tracer.linking.link reads as it
reads a CPU or GPU run's. The steps, in order: `_Below` (what ran below the mode),
`_saved_detaches` (autograd's detaches that only the mode causes), `_kept_nodes` (the ET
without them, the mode's own nodes spliced out), `_stand_in_outputs` (collect's attention
range gets its operator's output), `_align` (which mode call each ET operator is),
`_rename_tensors` (ET tensor ids replaced by the mode's numbers). The kept nodes are new
dicts but share the caller's "inputs" and "outputs", whose tensor values are renamed in
place: after the call, read the returned ET, not the one handed in.
"""

from __future__ import annotations

import copy
import difflib
from collections import defaultdict

from tracer.et_nodes import is_op, tensor_args, tensor_items
from tracer.et_storage import STORAGE_BASE

_DISPATCH_MODE = "PythonDispatchMode"
_STAND_INS = {"aten::scaled_dot_product_attention"}  # tracer.meta_run.cpu_attention's range


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
    dropped = _Below(by_id, parent)
    same_as = _saved_detaches(by_id, parent, dropped)
    kept = _kept_nodes(nodes, by_id, parent, dropped)
    _stand_in_outputs(kept)
    named = _align(by_id, dropped, numbers)
    _rename_tensors(kept, named, same_as, storages)
    return {**et, "nodes": kept}


def _mode_under_op(n: dict) -> bool:
    """A mode node of an operator (drop what is below it), not of a record_function
    range entering (a String argument) or leaving (an Object) through the mode."""
    types = n.get("inputs", {}).get("types") or [""]
    return n["name"] == _DISPATCH_MODE and types[0] not in ("String", "Object")


def _call_label(name: str) -> str:
    """A mode call's operator ("aten.mm.default") as the ET names it ("aten::mm"); a
    record_function range's call is "profiler"."""
    ns, _, rest = name.partition(".")
    return "profiler" if ns == "profiler" else f"{ns}::{rest.split('.')[0]}"


class _Below:
    """Called with a node id: whether the node is dropped, that is, it is an operator's mode
    node, is below one, or is below (or is) a node marked with `drop`. Verdicts are
    remembered along each walk up, so a node marked after its verdict was given keeps it:
    mark first (`_saved_detaches`), then ask."""

    def __init__(self, by_id: dict, parent: dict):
        self.by_id, self.parent = by_id, parent
        self.verdict: dict[int, bool] = {}

    def drop(self, i: int) -> None:
        self.verdict[i] = True

    def __call__(self, i) -> bool:
        chain, verdict = [], False
        while True:
            if i in self.verdict:
                verdict = self.verdict[i]
                break
            if i not in self.by_id:
                break
            chain.append(i)
            if _mode_under_op(self.by_id[i]):
                verdict = True
                break
            p = self.parent.get(i)
            if p is None or p == i:
                break
            i = p
        for j in chain:
            self.verdict[j] = verdict
        return verdict


def _saved_detaches(by_id: dict, parent: dict, dropped: _Below) -> dict[int, int]:
    """Marks dropped (in `dropped`) each one-in, one-out detach the dispatch mode makes
    autograd issue when it saves or unpacks a tensor for backward, inside an operator or
    autograd node: a run without the mode has none (AccumulateGrad's own detach, which
    steals a gradient, is real). Returns its output's ET tensor id -> its input's."""

    def saved_detach(i):
        n = by_id[i]
        p = by_id.get(parent[i], {}).get("name", "")
        inside = not p.startswith(("##", "ProfilerStep")) and "AccumulateGrad" not in p
        return n["name"] == "aten::detach" and inside

    same_as: dict[int, int] = {}
    for i in sorted(by_id):
        if saved_detach(i):
            ins, outs = tensor_items(by_id[i]["inputs"]), tensor_items(by_id[i]["outputs"])
            if len(ins) == 1 and len(outs) == 1:
                same_as[outs[0][0]] = ins[0][0]
                dropped.drop(i)
    return same_as


def _kept_nodes(nodes: list, by_id: dict, parent: dict, dropped: _Below) -> list[dict]:
    """The nodes not dropped and not the mode's own, in ET order, each a new dict (its
    "inputs" and "outputs" still the ET's) whose parent skips the mode nodes above it."""
    kept = []
    for n in nodes:
        if dropped(n["id"]) or n["name"] == _DISPATCH_MODE:
            continue  # below an operator, or a record_function passing through the mode
        p = parent.get(n["id"])
        while p in by_id and by_id[p]["name"] == _DISPATCH_MODE and p != parent.get(p):
            p = parent.get(p)
        kept.append({**n, "ctrl_deps": p} if "ctrl_deps" in n else {**n, "parent": p})
    return kept


def _stand_in_outputs(kept: list[dict]) -> None:
    """A range standing in for a composite operator (tracer.meta_run.cpu_attention) has its
    inputs; its output is its operator's first: set (a deep copy of) it, in place."""
    kids: dict[int, list] = defaultdict(list)
    for n in kept:
        kids[n.get("ctrl_deps", n.get("parent"))].append(n)
    for n in kept:
        if n["name"] in _STAND_INS and not n.get("outputs", {}).get("values"):
            inner = [c for c in kids.get(n["id"], []) if is_op(c["name"])]
            if inner and inner[0].get("outputs", {}).get("values"):
                o = inner[0]["outputs"]
                n["outputs"] = {
                    k: copy.deepcopy(o[k][:1])
                    for k in ("values", "shapes", "types", "strides")
                    if o.get(k)
                }


def _align(by_id: dict, dropped: _Below, numbers: list) -> dict[int, tuple[list, list]]:
    """ET operator node id -> (input numbers, output numbers) of its mode call.

    The mode's calls are, in order, the operators that reached it (and the record_function
    ranges passing through it); align them with the ET's operators by name: composite
    operators (aten::linear) never reach the mode, and a few operators (the detach
    AccumulateGrad makes) reach it without leaving a mode node to count on."""
    seq = [
        (i, by_id[i]["name"])
        for i in sorted(by_id)
        if (not dropped(i) and is_op(by_id[i]["name"]))
        or (by_id[i]["name"] == _DISPATCH_MODE and not _mode_under_op(by_id[i]))
    ]
    matcher = difflib.SequenceMatcher(
        None,
        [name if name != _DISPATCH_MODE else "profiler" for _, name in seq],
        [_call_label(c[2]) for c in numbers],
        autojunk=False,
    )
    named: dict[int, tuple[list, list]] = {}
    for blk in matcher.get_matching_blocks():
        for k in range(blk.size):
            named[seq[blk.a + k][0]] = numbers[blk.b + k][:2]
    return named


def _rename_tensors(kept: list[dict], named: dict, same_as: dict, storages: dict | None) -> None:
    """Rename the kept nodes' tensors, in place, in time order: a node's inputs when it
    starts, its outputs once its subtree ran; by the mode's number where `named` has the
    node's call (see `_Renamer`)."""
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
    renamer = _Renamer(same_as, storages)
    for _, kind, n, side in events:
        nums = named.get(n["id"])
        renamer.rename(n.get(side, {}), None if nums is None else nums[kind])


class _Renamer:
    """ET tensor ids -> numbers, as a run goes: `current` holds the number each ET tensor id
    names now; an id seen without a mode number takes its detach source's number
    (`same_as`: output id -> input id) or a fresh one from STORAGE_BASE on. With
    `storages` (number -> the mode's storage address), a numbered tensor's storage id
    becomes its storage's."""

    def __init__(self, same_as: dict, storages: dict | None):
        self.same_as, self.storages = same_as, storages
        self.current: dict[int, int] = {}  # ET tensor id -> number of the tensor it names now
        self.fresh = iter(range(STORAGE_BASE, 2 * STORAGE_BASE))

    def rename(self, side: dict, nums: list | None) -> None:
        """Rename the tensor values of one side of a node, in place; nums: the mode's
        numbers for that side, or None where the node is no mode call."""
        # the mode's numbers go to the tensors it was handed, in order: not an undefined
        # tensor nor a wrapped number (`_unseen_by_mode`). A tensor left without one is named
        # by its ET id, the address of its TensorImpl, which PyTorch reuses once a tensor is
        # freed: a tensor the mode numbered must never be named so (it took a freed
        # tensor's number, and storage, wherever the allocator had put it: a weight's view
        # made attention's saved output a "buffer" in some runs), and a wrapped number is
        # made anew for each call
        current, storages = self.current, self.storages
        items = tensor_items(side)
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
                    current[x[0]] = next(self.fresh)
        for x in items:
            if x[0] not in current:
                src = self.same_as.get(x[0])
                current[x[0]] = current[src] if src in current else next(self.fresh)
            x[0] = current[x[0]]
            if storages and x[0] in storages:
                x[1] = storages[x[0]]


def _unseen_by_mode(side) -> dict:
    """The tensor values (by id()) of an ET node's inputs or outputs that a dispatch mode is
    not handed as tensors: "undefined", an absent optional tensor (attn_mask=None), which
    the autograd-level call records as a tensor with no storage and no device; "wrapped",
    a 0-dim CPU float64 or int64 tensor, maybe a wrapped number (a Python scalar where the
    schema takes a tensor: `step += 1` is aten::add_.Tensor), which the mode gets back as
    the Python number."""
    out = {}
    for items, t, s in zip(
        tensor_args(side), side.get("types", []), side.get("shapes", []), strict=False
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
