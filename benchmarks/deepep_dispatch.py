"""DeepEP's dispatch and combine (`dispatcher: deepep`) against DeepEP's published bandwidths.

Published (kept as data; deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels with NVLink
and RDMA forwarding"): H800 (~160 GB/s NVLink), a CX7 400 Gb/s NIC per GPU (~50 GB/s),
DeepSeek-V3's pretraining setting: 4,096 tokens a GPU, hidden 7168, top-4 groups, top-8
experts (256), FP8 dispatch, BF16 combine. Bottleneck bandwidth (RDMA, GB/s): EP 16
dispatch 43 / combine 43, EP 32 58 / 57, EP 64 51 / 50. DeepEP's test counts it as the
tokens sent to every node they are routed to, the sender's own included, x hidden x the
bytes a value (FP8: 1 + 4/128 for the scales), over the kernel's time
(tests/test_internode.py).

Here: the same bytes matrix as the EP plan makes (moe_loads.deepep_sizes, uniform group-
limited routing) on a multi_node system of 8-GPU nodes with those bandwidths, run by the
NCCL model's uneven all-to-all with algorithm deepep (no per-pair cap); the published
time is DeepEP's logical bytes over its bandwidth.

Run: PYTHONPATH=. python benchmarks/deepep_dispatch.py
Prints one row per kernel and EP degree (simulated, published, ratio) and the last line
`N kernels: simulated / published median R, range A-B`.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from extrapolators.modes import moe_loads
from triosim.config.loading import from_dict
from triosim.studies.calibration import system

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {16: (43e9, 43e9), 32: (58e9, 57e9), 64: (51e9, 50e9)}  # dispatch, combine B/s
TOKENS, HIDDEN, TOP_K, EXPERTS, GROUP_TOPK = 4096, 7168, 8, 256, 4
FP8, BF16 = HIDDEN * (1 + 4 / 128), HIDDEN * 2.0
NVLINK, NIC = 160e9, 50e9


def simulate(ep: int) -> list[tuple]:
    """[(kernel, simulated s, published s)] at EP degree `ep` (ep / 8 nodes)."""
    nodes = ep // 8
    cfg = from_dict(
        {
            "num_gpus": ep,
            "trace": str(ROOT / "traces/modelled/h100-sxm/deepseek-v3-s4096-b1.trace.json.gz"),
            "communication": {"kind": "nccl"},
            "topology": {
                "kind": "multi_node",
                "gpus_per_node": 8,
                "bandwidth": NVLINK,
                "latency": 1e-6,
                "inter_bandwidth": NIC,
                "inter_latency": 5e-6,
            },
        }
    )
    env, _, comm, group = system(cfg)
    top = min(nodes, GROUP_TOPK)  # DeepEP's test: min(nodes, 4) groups, a group a node
    uniform = [1 / EXPERTS] * EXPERTS
    copies = moe_loads.dispatch_sizes(
        moe_loads.kept_tokens(uniform, TOKENS, TOP_K, ep, None), ep, 1.0
    )
    tokens = moe_loads.deepep_sizes(copies, [j // 8 for j in range(ep)], EXPERTS, TOP_K, nodes, top)
    per_node = EXPERTS // nodes
    p_node = moe_loads.hit_probability([per_node] + [0] * (nodes - 1), per_node, top, TOP_K)
    logical = nodes * p_node * TOKENS  # DeepEP's count: every node a token is routed to
    out = []
    for name, nbytes, bw in (
        ("dispatch fp8", FP8, PUBLISHED[ep][0]),
        ("combine bf16", BF16, PUBLISHED[ep][1]),
    ):
        sizes = tuple(tuple(x * nbytes for x in row) for row in tokens)
        if name.startswith("combine"):
            sizes = moe_loads.transpose(sizes)
        start = env.now
        env.process(
            comm.run("all_to_all", tuple(group), 0.0, tag=name, algorithm="deepep", sizes=sizes)
        )
        env.run()
        out.append((name, env.now - start, logical * nbytes / bw))
    return out


def main() -> None:
    print("| EP | kernel | simulated ms | DeepEP ms | ratio |")
    print("|---|---|---|---|---|")
    ratios = []
    for ep in PUBLISHED:
        for name, sim, pub in simulate(ep):
            ratios.append(sim / pub)
            print(f"| {ep} | {name} | {sim * 1e3:.3f} | {pub * 1e3:.3f} | {sim / pub:.2f} |")
    print(
        f"{len(ratios)} kernels: simulated / published median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
