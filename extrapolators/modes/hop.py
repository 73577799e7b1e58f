"""Hop: heterogeneity-aware decentralized training (Luo et al., ASPLOS 2019; TrioSim 7.2).

No global all-reduce. Every worker runs `iterations` iterations on its own share of the
batch; after its backward pass it sends its update (the model's weight bytes) to each
out-neighbour of a communication graph, one queue (send stream) per edge; before its
optimizer step of iteration k it waits for its in-neighbours' updates:

- **update queues**: an update of iteration k from j to w is the message
  `hop:upd:j->w:k`; edges deliver in order (one send stream per edge).
- **bounded staleness** `staleness = s`: w may use an update up to s iterations old, so it
  waits for iteration k - s (nothing for k < s).
- **backup workers** `backup_workers = b`: w proceeds once all but b in-neighbours'
  updates have arrived; a late update is not waited for, and counts towards a later
  iteration when it arrives (it is in the queue).
- **token queues** `max_gap = T`: w starts iteration k only once every out-neighbour has
  finished iteration k - T, so no worker runs more than T iterations ahead of a receiver.

The iteration gap, the waits and who waited for whom are all in the timeline (wait rows
carry the keys of the updates waited for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import networkx as nx

from extrapolators.execution.tasks import Iteration, Send, Signal, Wait, WaitSome
from extrapolators.modes.base import Extrapolator
from triosim.common.errors import ConfigError
from triosim.common.schema import option


@dataclass(frozen=True)
class HopOptions:
    graph: Literal["topology", "ring", "ring_chord", "double_ring", "fully_connected"] = option(
        "topology",
        help="communication graph: GPUs linked directly or through switches in "
        "the topology, or a named graph",
    )
    backup_workers: int = option(0, ge=0, help="in-neighbours' updates a worker may go on without")
    staleness: int = option(0, ge=0, help="how many iterations old an update may be")
    max_gap: int = option(
        4, ge=1, help="token queues: iterations a worker may run ahead of an out-neighbour"
    )


class Hop(Extrapolator):
    name = "hop"
    Options = HopOptions
    owns_iterations = True  # runs its iterations itself: workers do not wait for each other

    def check(self):
        self.per_gpu_batch(len(self.gpus))
        o, n = self.options, len(self.gpus)
        if o.graph == "topology":
            if self.graph is None:
                raise ConfigError(
                    "parallelism.graph", "topology", "a named graph, when no topology is given"
                )
            g = _gpu_graph(self.graph, self.gpus)
        else:
            from networks import topology as topo

            build = {
                "ring": topo.ring,
                "ring_chord": topo.ring_chord,
                "double_ring": topo.double_ring,
                "fully_connected": topo.fully_connected,
            }
            g = nx.relabel_nodes(build[o.graph](n, 1.0), dict(enumerate(self.gpus)))
        self.out_nbrs = {
            w: sorted((v for v in g.successors(w) if v != w), key=self.gpus.index)
            for w in self.gpus
        }
        self.in_nbrs = {
            w: sorted((v for v in g.predecessors(w) if v != w), key=self.gpus.index)
            for w in self.gpus
        }
        if n > 1:
            lonely = [w for w in self.gpus if not self.in_nbrs[w]]
            if lonely:
                raise ConfigError(
                    "parallelism.graph",
                    o.graph,
                    f"a graph where every GPU has an in-neighbour (GPU {lonely[0]} has none)",
                )
            fewest = min(len(v) for v in self.in_nbrs.values())
            if o.backup_workers >= fewest:
                raise ConfigError(
                    "parallelism.backup_workers",
                    o.backup_workers,
                    f"fewer than the smallest in-degree ({fewest}): a worker must "
                    "wait for at least one update",
                )

    def update_bytes(self) -> float:
        return self.trace.weight_bytes()

    def streams(self, iterations: int = 1):
        out = {}
        for w in self.gpus:
            out[(w, "compute")] = self._worker(w, iterations)
            for j in self.out_nbrs[w]:
                out[(w, f"send->{j}")] = self._sender(w, j, iterations)
        return out

    def _worker(self, w, iterations):
        o = self.options
        target = self.target(self.per_gpu_batch(len(self.gpus)))
        need = len(self.in_nbrs[w]) - o.backup_workers
        for k in range(iterations):
            yield Iteration(k)
            if k >= o.max_gap:  # a token from every out-neighbour
                for j in self.out_nbrs[w]:
                    yield Wait(f"hop:done:{j}:{k - o.max_gap}")
            for op in self.ops("forward", "backward"):
                yield self.compute(op, target)
            yield Signal(f"hop:grad:{w}:{k}")
            if k >= o.staleness and self.in_nbrs[w]:
                keys = tuple(f"p2p:hop:upd:{j}->{w}:{k - o.staleness}" for j in self.in_nbrs[w])
                yield WaitSome(keys, need, layer="updates", phase="optimizer")
            for op in self.ops("optimizer"):
                yield self.compute(op, target)
            yield Signal(f"hop:done:{w}:{k}")

    def _sender(self, w, j, iterations):
        for k in range(iterations):
            yield Iteration(k)
            yield Wait(f"hop:grad:{w}:{k}")
            yield Send(
                j, self.update_bytes(), f"hop:upd:{w}->{j}:{k}", layer="update", phase="backward"
            )


def _gpu_graph(graph, gpus) -> nx.DiGraph:
    """GPU u -> v when v is reachable from u through switches only (directly, or over an
    NVSwitch or a network switch): who can send to whom without another GPU forwarding."""
    members = set(gpus)
    g = nx.DiGraph()
    g.add_nodes_from(gpus)
    for u in gpus:
        seen, todo = {u}, [u]
        while todo:
            for v in graph.successors(todo.pop()):
                if v in seen:
                    continue
                seen.add(v)
                if v in members:
                    g.add_edge(u, v)
                else:
                    todo.append(v)
    return g
