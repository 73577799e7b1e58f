"""How fast the packet-switch allocator is: one step with one flow per GPU in flight.

For 64, 256 and 1024 GPUs on a fat tree (leaf-spine, radix 64) and a 2D torus, every GPU
starts one 100 MB transfer to a random other GPU (a permutation) at the same instant; the
run ends when all are delivered. Prints wall time, reallocations and flows per second
(flows completed / wall second). Run: python benchmarks/network_speed.py
"""

from __future__ import annotations

import math
import time

import numpy as np
import simpy

from networks import PacketSwitchNetwork
from networks import topology as topo


def one_step(graph, n, seed=0):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    while (perm == np.arange(n)).any():  # no self-transfers
        perm = rng.permutation(n)
    env = simpy.Environment()
    t0 = time.perf_counter()
    net = PacketSwitchNetwork(env, graph)
    net.transfer_group([(i, int(perm[i]), 100e6) for i in range(n)])
    env.run()
    wall = time.perf_counter() - t0
    return wall, net.reallocations, env.now


def main():
    print(
        f"{'topology':<10} {'GPUs':>5} {'wall s':>8} {'realloc':>8} {'flows/s':>10} {'sim time ms':>12}"
    )
    for n in (64, 256, 1024):
        side = int(math.isqrt(n))
        for name, g in (
            ("fat_tree", topo.fat_tree(n, 50e9, 1e-6, radix=64)),
            ("torus2d", topo.torus2d(side, n // side, 50e9, 1e-6)),
        ):
            wall, realloc, sim = one_step(g, n)
            print(
                f"{name:<10} {n:>5} {wall:>8.3f} {realloc:>8} {n / wall:>10.0f} {sim * 1e3:>12.3f}"
            )


if __name__ == "__main__":
    main()
