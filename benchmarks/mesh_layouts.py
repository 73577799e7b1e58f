"""The layouts of published torchtitan runs on the device mesh (examples/titan_*.yaml): each
simulated as published and at 1,024 GPUs, symmetric, with the wall time it took.

Published (torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, December 2024: Grand
Teton hosts of 8 H100s with 96 GB HBM2e at 500 W, NVLink inside a host, 400 Gb/s RDMA per
GPU; tokens/s per GPU read at iteration 90): Llama 3.1 8B FSDP on 8 GPUs 5,762 (Table 1,
bf16, no torch.compile), on 128 GPUs 5,605 (Table 3); 70B FSDP 32 x TP 8 on 256 GPUs 829
(Table 4, torch.compile + Float8); 405B FSDP 8 x TP 8 x PP 8 on 512 GPUs 100 with 1F1B and
128 interleaved (Table 5, compile + Float8 + async TP); 405B FSDP 4 x CP 2 x TP 8 x PP 8 at
64K tokens 47 (Table 6, the same). Only the 8B rows are bf16 without compile, as the model
runs (no FP8, no compiler fusion, no async TP): the others bound what is left out, they do
not validate it. The H100s are modelled as the catalogue's H100-SXM (80 GB HBM3, 700 W).

Megatron-Core's (mode ep, examples/megatron_*.yaml; benchmarks/llm_parallelism.py says
more): Mixtral 8x7B EP 8 x PP 4 (VP 8) on 64 H100s, 468 TFLOPS per GPU in bf16; DeepSeek-V3
EP 64 x PP 16, 1,543 tokens/s per GPU on 2,048 H800s in FP8 with DualPipe (here 1,024 GPUs,
1F1B, bf16).

Tokens/s per GPU = global batch x sequence / GPUs / iteration time; TFLOPS per GPU = the
trace's forward and backward FLOPs per sequence x sequences per GPU / iteration time.

Run: PYTHONPATH=. python benchmarks/mesh_layouts.py [--only NAME] [--no-1024]
"""

from __future__ import annotations

import argparse
import re
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ROWS = [
    # name, example, overrides at the published size, published tokens/s/GPU, what it was
    ("Llama 3.1 8B FSDP 8", "titan_llama8b_fsdp", {}, 5762, "bf16"),
    ("Llama 3.1 8B FSDP 128", "titan_llama8b_fsdp",
     {"num_gpus": 128, "batch_size": 256, "parallelism.dp_shard": 128}, 5605, "bf16"),
    ("Llama 3.1 8B HSDP 8 x 8", "titan_llama8b_hsdp", {}, None, ""),
    ("Llama 3.1 70B FSDP 32 x TP 8", "titan_llama70b_fsdp_tp", {}, 829, "fp8+compile"),
    ("Llama 3.1 405B FSDP 8 x TP 8 x PP 8, 1F1B", "titan_llama405b_3d", {}, 100,
     "fp8+compile+asyncTP"),
    ("Llama 3.1 405B 3D, interleaved", "titan_llama405b_3d",
     {"parallelism.schedule": "interleaved", "parallelism.virtual_stages": 2}, 128,
     "fp8+compile+asyncTP"),
    ("Llama 3.1 405B FSDP 4 x CP 2 x TP 8 x PP 8, 64K", "titan_llama405b_4d", {}, 47,
     "fp8+compile+asyncTP"),
    # Megatron-Core (mode ep): TFLOPS per GPU published for Mixtral, tokens/s for DeepSeek
    ("Mixtral 8x7B EP 8 x PP 4 (VP 8), dense DP 16", "megatron_mixtral", {}, "468 TFLOPS",
     "bf16, MCore v0.9"),
    ("DeepSeek-V3 EP 64 x PP 16 (1,024 GPUs)", "megatron_deepseek_v3", {}, 1543,
     "fp8, DualPipe, 2,048 H800"),
]  # fmt: skip

AT_1024 = {  # the same layout grown to 1,024 GPUs (more data-parallel ranks, same local batch)
    "titan_llama8b_fsdp": {"num_gpus": 1024, "batch_size": 2048, "parallelism.dp_shard": 1024},
    "titan_llama8b_hsdp": {"num_gpus": 1024, "batch_size": 2048, "parallelism.dp_replicate": 128},
    "titan_llama70b_fsdp_tp": {"num_gpus": 1024, "batch_size": 2048, "parallelism.dp_shard": 128},
    "titan_llama405b_3d": {"num_gpus": 1024, "batch_size": 512, "parallelism.dp_shard": 16},
    "titan_llama405b_4d": {"num_gpus": 1024, "batch_size": 64, "parallelism.dp_shard": 8},
    "megatron_mixtral": {"num_gpus": 1024, "batch_size": 4096},
}


def simulate(example: str, overrides: dict):
    """(Result, Config, wall seconds) of an example with dotted-field overrides (as
    `triosim simulate EXAMPLE --set FIELD=VALUE`)."""
    from triosim import Simulation
    from triosim.config.loading import from_dict, read_yaml, set_field

    path = ROOT / "examples" / f"{example}.yaml"
    data = read_yaml(path)
    for k, v in overrides.items():
        set_field(data, k, v)
    t0 = time.perf_counter()
    sim = Simulation(from_dict(data, base_dir=path.parent))
    r = sim.run()
    return r, sim.config, time.perf_counter() - t0


def tflops_per_gpu(r, cfg, trace) -> float:
    """The trace's forward and backward FLOPs per sequence x sequences per GPU / time."""
    flops = sum(o.flops or 0.0 for o in trace.operators if o.phase in ("forward", "backward"))
    return flops / trace.batch_size * cfg.batch_size / cfg.num_gpus / r.iteration_time / 1e12


def tokens_per_gpu(r, cfg) -> float:
    """Global batch x sequence (from the trace's name, -sNNNN-) / GPUs / iteration time."""
    seq = int(Path(cfg.trace).name.split("-s")[1].split("-")[0])
    return cfg.batch_size * seq / cfg.num_gpus / r.iteration_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="rows whose name contains this")
    ap.add_argument("--no-1024", action="store_true", help="skip the 1,024-GPU runs")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    print(
        "| layout | GPUs | iteration s | tokens/s/GPU | published | (as) | peak GB | "
        "symmetry | wall s | 1,024 GPUs: iteration s | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    walls = []
    for name, example, over, published, how in ROWS:
        if args.only and args.only not in name:
            continue
        r, cfg, wall = simulate(example, over)
        tps = tokens_per_gpu(r, cfg)
        big = ("", "")
        if not args.no_1024 and not over and example in AT_1024:
            rb, cb, wb = simulate(example, AT_1024[example])
            big = (f"{rb.iteration_time:.3f}", f"{wb:.1f}")
            walls.append(wb)
        pub = f"{published:,}" if isinstance(published, int) else published or ""
        if isinstance(published, str) and "TFLOPS" in published:
            from triosim.trace.files import load_any_trace

            tf = tflops_per_gpu(r, cfg, load_any_trace(cfg.trace_path()))
            pub += f" (predicted {tf:.0f})"
        peak = max(r.peak_memory.values()) / 1e9 if r.peak_memory else float("nan")
        sym = re.sub(
            r" \(fell back from (\d+) representatives? of \d+ GPUs: .*\)$",
            r" (fell back from \1)",
            r.symmetry,
        )
        print(
            f"| {name} (`{example}`) | {cfg.num_gpus} | {r.iteration_time:.3f} | {tps:,.0f} | {pub} | {how} "
            f"| {peak:.1f} | {sym} | {wall:.1f} | {big[0]} | {big[1]} |",
            flush=True,
        )
    if walls:
        print(f"\n1,024-GPU runs: {len(walls)}, wall {min(walls):.1f} to {max(walls):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
