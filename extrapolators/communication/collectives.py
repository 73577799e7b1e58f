"""The textbook collective algorithms (communication kind 'textbook') as SimPy generators
over the Network interface.

Each step of an algorithm starts all its transfers as one group (one bandwidth
allocation) and waits for all of them; a ring's lock-step steps are one `Network.ring`
call (the packet network computes them as one job when the ring has its links to
itself). Ring all-reduce: reduce-scatter then
all-gather, the buffer cut into N chunks, 2(N-1) steps; with lone links of
bandwidth B and latency L it takes 2(N-1)/N x bytes/B + 2(N-1) x L.
Register a new algorithm with `register(op, name)`; `communication.algorithm` names it.
"""

from __future__ import annotations

from extrapolators.communication.rings import ring_order  # noqa: F401  (re-exported: its old home)
from triosim.common.errors import ConfigError
from triosim.common.registry import Registry

# keyed "op:name" (e.g. "allreduce:ring"); `communication.algorithm` names the algorithm
ALGORITHMS = Registry("communication.algorithm", "algorithm", "collective algorithm")


def register(op: str, name: str, *, replace: bool = False):
    def deco(fn):
        return ALGORITHMS.register(f"{op}:{name}", fn, replace=replace)

    return deco


def names() -> list[str]:
    """Algorithm names a config may choose (those that implement an all-reduce)."""
    return sorted(k.split(":", 1)[1] for k in ALGORITHMS.names() if k.startswith("allreduce:"))


def algorithm(op: str, name: str):
    key = f"{op}:{name}"
    if key not in ALGORITHMS:
        pairs = [k.split(":", 1) for k in ALGORITHMS.names()]
        allowed = sorted(n for o, n in pairs if o == op)
        if not allowed:
            raise ConfigError(
                "collective", op, f"one of {', '.join(sorted({o for o, _ in pairs}))}"
            )
        raise ConfigError("communication.algorithm", name, f"one of {', '.join(allowed)} for {op}")
    return ALGORITHMS.get(key)


def _step(env, net, transfers, tag):
    if transfers:
        yield net.transfer_all(transfers, tag=tag)


def _ring_steps(env, net, group, chunk, steps, tag):
    # the network runs the lock-step ring itself: one event, however many steps
    yield net.ring(group, chunk, steps, tag)


@register("allreduce", "ring")
def ring_allreduce(env, net, group, nbytes, tag="allreduce", root=None):
    n = len(group)
    if n > 1:
        yield from _ring_steps(env, net, group, nbytes / n, 2 * (n - 1), tag)


@register("reduce_scatter", "ring")
def ring_reduce_scatter(env, net, group, nbytes, tag="reduce_scatter", root=None):
    n = len(group)
    if n > 1:
        yield from _ring_steps(env, net, group, nbytes / n, n - 1, tag)


@register("all_gather", "ring")
def ring_all_gather(env, net, group, nbytes, tag="all_gather", root=None):
    """nbytes is the gathered buffer each GPU ends with."""
    n = len(group)
    if n > 1:
        yield from _ring_steps(env, net, group, nbytes / n, n - 1, tag)


def _chain(group, root):
    i = group.index(root) if root in group else 0
    return list(group[i:]) + list(group[:i])


@register("broadcast", "ring")
def ring_broadcast(env, net, group, nbytes, tag="broadcast", root=None):
    """Pipelined chain from the root: N chunks flow down N-1 hops in 2N-2 steps."""
    order = _chain(list(group), root)
    n = len(order)
    if n < 2:
        return
    chunk = nbytes / n
    for step in range(2 * n - 2):
        hops = [(order[h], order[h + 1], chunk) for h in range(n - 1) if 0 <= step - h < n]
        yield from _step(env, net, hops, tag)


@register("reduce", "ring")
def ring_reduce(env, net, group, nbytes, tag="reduce", root=None):
    """A pipelined chain in ring direction that ends at the root (starts just after it)."""
    group = list(group)
    i = group.index(root) if root in group else 0
    start = group[(i + 1) % len(group)]
    yield from ring_broadcast(env, net, _chain(group, start), nbytes, tag, root=start)


@register("all_to_all", "direct")
def direct_all_to_all(env, net, group, nbytes, tag="all_to_all", root=None):
    """Every GPU sends nbytes/N to every other, all at once."""
    n = len(group)
    pairs = [(a, b, nbytes / n) for a in group for b in group if a != b]
    yield from _step(env, net, pairs, tag)


def check_sizes(group, sizes) -> None:
    """An uneven all-to-all's sizes: an N x N table of finite bytes >= 0 (ConfigError)."""
    n = len(group)
    ok = len(sizes) == n and all(len(row) == n for row in sizes)
    if not ok or not all(0 <= x < float("inf") for row in sizes for x in row):
        raise ConfigError(
            "all_to_all sizes", sizes, f"a {n} x {n} table of finite bytes >= 0 (sender, receiver)"
        )


def direct_all_to_allv(env, net, group, sizes, tag="all_to_all"):
    """An all-to-all of uneven sizes: every GPU sends sizes[i][j] bytes to GPU j, all at
    once (the diagonal stays on its GPU)."""
    check_sizes(group, sizes)
    pairs = [
        (a, b, sizes[i][j])
        for i, a in enumerate(group)
        for j, b in enumerate(group)
        if i != j and sizes[i][j] > 0
    ]
    yield from _step(env, net, pairs, tag)


@register("sendrecv", "direct")
def direct_sendrecv(env, net, group, nbytes, tag="sendrecv", root=None):
    """nccl-tests' sendrecv: every GPU sends nbytes to the next one, all at once."""
    n = len(group)
    if n > 1:
        yield from _step(env, net, [(group[i], group[(i + 1) % n], nbytes) for i in range(n)], tag)
