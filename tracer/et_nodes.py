"""Reading a PyTorch Execution Trace's nodes: their attributes, their tensor arguments, and
the tree they form.

An ET node is a dict with "id", "name", "inputs" and "outputs" (each a dict of parallel
lists "values", "types", "shapes"), "attrs" (a list of {"name", "value"}) and its parent's id
("ctrl_deps", or "parent" in older schemas). A tensor value is a 6-element list (tensor
id, storage id, offset, element count, element size, device). These helpers read nodes as
they are and change nothing, except that `tensor_args` and `tensor_items` hand back the
6-element lists themselves, for a caller to edit in place (tracer.et_storage,
tracer.meta_trace).
"""

from __future__ import annotations

from collections import defaultdict


def node_attrs(node) -> dict:
    """A node's attributes, name -> value."""
    return {a["name"]: a["value"] for a in node.get("attrs", [])}


def is_op(name: str) -> bool:
    """Whether a node's name is an operator's (not a record_function range or a profiler
    node)."""
    return "::" in name and not name.startswith("[pytorch") and not name.startswith("##")


def tensor_values(vals, types, shapes):
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


def side_values(side) -> list:
    """`tensor_values` of a node's inputs or outputs (a side must have "values")."""
    return list(tensor_values(side["values"], side.get("types", []), side.get("shapes", [])))


def tensor_args(side) -> list[list]:
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


def tensor_items(side):
    """The 6-element tensor values of an ET node's inputs or outputs, lists flattened."""
    return [x for items in tensor_args(side) for x in items]


class EtTree:
    """The nodes of an Execution Trace as a tree, read once: `nodes` (id -> node), `parent`
    (id -> its parent's id; the root, which names itself as its parent, has none, so walks
    up the tree end), `attrs` (id -> node_attrs), `children` (id -> child ids, a defaultdict
    read with .get). The nodes are not copied: a change to one shows through."""

    def __init__(self, nodes: list):
        self.nodes = {n["id"]: n for n in nodes}
        self.parent = {
            i: p for i, n in self.nodes.items() if (p := n.get("ctrl_deps", n.get("parent"))) != i
        }
        self.attrs = {i: node_attrs(n) for i, n in self.nodes.items()}
        self.children = defaultdict(list)
        for i, p in self.parent.items():
            self.children[p].append(i)

    def ancestors(self, i):
        """Yield the ids above node i, nearest first (a cycle ends the walk)."""
        p, seen = self.parent.get(i), {i}
        while p in self.nodes and p not in seen:
            seen.add(p)
            yield p
            p = self.parent.get(p)

    def subtree(self, i):
        """Yield node i and every node below it (depth first, last child first)."""
        stack = [i]
        while stack:
            j = stack.pop()
            yield j
            stack.extend(self.children.get(j, ()))
