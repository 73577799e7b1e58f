"""FLOPs of a linked operator from PyTorch's own flop counter.

`node_flops(nodes, i, subtree, children)` is the `flops_of` that tracer.linking.link takes:
the FLOPs of top-level ET node i (nodes: id -> ET node; subtree(i): the ids under i;
children: id -> child ids, read with .get), summed over its outermost sub-operators that
torch.utils.flop_counter knows, fed the recorded shapes; None where it knows none (the
linker then uses triosim.trace.flops's formulas). Imports PyTorch when called.
"""

from __future__ import annotations


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
