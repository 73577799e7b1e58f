"""Storage ids for an Execution Trace's tensors: which tensors are views of one memory.

`alias_storage` rewrites, in place, the storage id (the second of a tensor value's six
elements) of every tensor in a list of ET nodes, from the operators' schemas: views share
their base's id, every other tensor has its own, numbered from STORAGE_BASE (far from any id
the ET hands out). It needs the nodes' "op_schema" attributes; without them it changes
nothing. tracer.linking calls it before reading tensors (tracer.meta_trace also numbers the
tensors it cannot name from STORAGE_BASE on: tensor ids, there).
"""

from __future__ import annotations

import re

from tracer.et_nodes import node_attrs, tensor_args, tensor_items

STORAGE_BASE = 1 << 40  # synthetic storage ids: far from any id the ET hands out


def alias_storage(nodes: list) -> bool:
    """Rewrite each tensor's storage id (in place) so that a view shares its base's storage
    and every other tensor has its own: an output whose schema alias set is an input's (e.g.
    `aten::t(Tensor(a) self) -> Tensor(a)`, `aten::add_(Tensor(a!) self, ...)`) joins that
    input's storage. The ET's own storage id is a data pointer, which the allocator hands to
    a new tensor once the old one is freed (an activation freed in backward and a gradient
    allocated in its place would share it), and which meta tensors do not have. Returns
    False, changing nothing, for an ET without operator schemas."""
    if not any(node_attrs(n).get("op_schema") for n in nodes):
        return False
    root: dict[tuple, tuple] = {}

    def find(k):
        while root.get(k, k) != k:
            k = root[k]
        return k

    def keys(side):  # per argument, the (id, storage) of its tensors and their element size
        return [[((x[0], x[1]), x[4]) for x in items] for items in tensor_args(side)]

    schemas: dict[str, tuple] = {}
    ordered = sorted(nodes, key=lambda n: n["id"])  # execution order
    for n in ordered:
        text = node_attrs(n).get("op_schema")
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
                for k, size in ks:
                    # `aten::to(Tensor(a) self, ...) -> Tensor(a)` may alias: it does only
                    # when no conversion is needed; an output of another element size is a
                    # copy (a float32 copy of a bfloat16 activation is new memory)
                    if size != base[1]:
                        continue
                    rk, rb = find(k), find(base[0])
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
            for x in tensor_items(side):
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
            for x in tensor_items(side):
                x[1] = storage.setdefault(find((x[0], x[1])), STORAGE_BASE + len(storage))
    return True


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
