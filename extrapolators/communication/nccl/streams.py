"""The streams of NCCL's schedules: (src, dst, share of the operation's bytes) for every
hop of every ring, chain, tree edge and switch leg, for one group of GPUs. One stream
becomes one flow through the network (extrapolators.communication.nccl.model); streams between the same two
ends are merged.

`rings` are ring orders with their share of the bytes (`weights`) and whether each runs
both ways (`both`); the rest comes from the group's System (extrapolators.communication.nccl.system).
"""

from __future__ import annotations

from extrapolators.communication.nccl.system import System, double_binary_trees


def hops(order) -> list[tuple]:
    """Consecutive pairs of a ring, the last back to the first."""
    order = list(order)
    return list(zip(order, order[1:] + order[:1], strict=True))


class _Acc(dict):
    def add(self, a, b, x):
        self[(a, b)] = self.get((a, b), 0.0) + x

    def streams(self) -> list:
        return [(a, b, x) for (a, b), x in self.items()]


def ring(rings, weights, both, per_hop: float) -> list:
    """Every hop of every ring (both ways where it runs both ways) carries per_hop of its
    ring's share: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter."""
    out = _Acc()
    for order, w, two in zip(rings, weights, both, strict=True):
        ways = [order, order[::-1]] if two else [order]
        for o in ways:
            for a, b in hops(o):
                out.add(a, b, per_hop * w / len(ways))
    return out.streams()


def chain(rings, weights, both, root, towards_root: bool) -> list:
    """Broadcast (from the root) or reduce (to it): each ring, cut at the root, as a chain."""
    out = _Acc()
    for order, w, two in zip(rings, weights, both, strict=True):
        ways = [order, order[::-1]] if two else [order]
        for o in ways:
            i = o.index(root) if root in o else 0
            c = list(o[i:]) + list(o[:i])
            for a, b in zip(c, c[1:], strict=False):
                out.add(*((b, a) if towards_root else (a, b)), w / len(ways))
    return out.streams()


def tree(s: System) -> list:
    """Tree all-reduce: up and down every edge. One node: two chains, one each way. Several:
    per rail, every node's chain to its rail GPU and a double binary tree between nodes."""
    out = _Acc()
    if s.N == 1:
        order = list(s.order)
        for a, b in zip(order, order[1:], strict=False):
            out.add(a, b, 1.0)
            out.add(b, a, 1.0)
        return out.streams()
    rails = s.rails if s.uniform else 1
    x = 1.0 / (2 * rails)
    for c in range(rails):
        for t in double_binary_trees(s.N):
            for k in range(s.N):
                ch = s.node_chain(k, c)
                for a, b in zip(ch, ch[1:], strict=False):
                    out.add(a, b, x)
                    out.add(b, a, x)
            for child, parent in t:
                a = s.nodes[child][c % len(s.nodes[child])]
                b = s.nodes[parent][c % len(s.nodes[parent])]
                out.add(a, b, x)
                out.add(b, a, x)
    return out.streams()


def nvls(s: System) -> list:
    """NVLS all-reduce in each node: each GPU sends its buffer to the switch, which reduces
    (S) and returns one reduced shard (S/n); each GPU stores its shard (S/n), which the switch
    multicasts to all (S)."""
    out = []
    for members, sw in zip(s.nodes, s.nvls, strict=True):
        x = 1 + 1 / len(members)
        for g in members:
            out += [(g, sw, x), (sw, g, x)]
    return out


def inter_tree(s: System, share: float) -> list:
    """Per rail, a double binary tree between nodes over `share` of the bytes."""
    out = _Acc()
    for c in range(s.rails):
        for t in double_binary_trees(s.N):
            for child, parent in t:
                a, b = s.nodes[child][c], s.nodes[parent][c]
                out.add(a, b, share / (2 * s.rails))
                out.add(b, a, share / (2 * s.rails))
    return out.streams()


def collnet(s: System) -> list:
    """SHARP (CollNet-direct): NVLS in each node, each GPU's shard (S/n) to its rail's
    reducing switch and back."""
    out = nvls(s)
    for members in s.nodes:
        for c, g in enumerate(members):
            out += [(g, s.sharp[c], 1 / len(members)), (s.sharp[c], g, 1 / len(members))]
    return out


def structure(s: System, rings, weights, both, op: str, algo: str, root=None) -> list:
    """The streams of `op` run with `algo` ('p2p' for all-to-all and sendrecv)."""
    n = s.n
    if op == "allreduce" and algo == "ring":
        return ring(rings, weights, both, 2 * (n - 1) / n)
    if op in ("all_gather", "reduce_scatter"):
        return ring(rings, weights, both, (n - 1) / n)
    if op in ("broadcast", "reduce"):
        return chain(rings, weights, both, root, towards_root=op == "reduce")
    if algo == "tree":
        return tree(s)
    if algo == "nvls":
        return nvls(s)
    if algo == "nvls_tree":
        return nvls(s) + inter_tree(s, 1 / s.ppn)
    if algo == "collnet_direct":
        return collnet(s)
    if op == "all_to_all":
        return [(a, b, 1.0 / n) for a in s.group for b in s.group if a != b]
    return [(a, b, 1.0) for a, b in hops(s.group)]  # sendrecv: every rank to the next
