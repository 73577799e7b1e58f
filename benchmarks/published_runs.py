"""Published training runs, configured as a user would, against their published throughput.

Each row is a run someone published with its layout, batch, sequence, GPU count and system,
simulated on a shipped shape-only trace of the model (traces/modelled/h100-sxm/: 2 layers
traced at full width and replicated, MODELLED H100 times from the calibrated operator
model) with the framework's settings as the config fields that model them. Kept here as
data, each with its source (numbers only; nothing else is copied):

- NeMo 24.07, DGX-H100, FP8 (NVIDIA/NeMo docs/source/performance/performance_summary.md,
  "Pretraining", container NeMo 24.07, the table as last revised for 24.07 at 8e3d65dcfe,
  2024-09-09, "24.07 perf numbers"; the first draft, 4c73f77670, had 12,036 and 1,533):
  LLAMA3-8B 8 GPUs, GBS 128, MBS 1, seq 8192, TP 1, PP 1, CP 2: 12,273 tokens/s/GPU;
  LLAMA3-70B 64 GPUs, GBS 128, MBS 1, seq 8192, TP 4, PP 4, CP 2, VP 5: 1,524. Gradients
  reduced in bfloat16 (NeMo-Framework-Launcher 24.07, examples/training/llama/h100/
  llama3_{8b,70b}_fp8.sh: `optim.grad_sync_dtype=bf16`).
- Megatron-Bridge, NeMo 25.09 container, DGX-H100, FP8 (NVIDIA-NeMo/Megatron-Bridge
  docs/performance-summary.md): LLAMA3_8B 8 GPUs, GBS 128, MBS 1, seq 8192, FSDP, GA 16:
  14,079; LLAMA3_70B 64 GPUs, GBS 128, MBS 1, TP 4, PP 8, VP 5, GA 64: 1,619;
  LLAMA3.1_405B 1,024 GPUs, GBS 512, MBS 1, TP 8, PP 8, CP 2, VP 8, GA 64: 302;
  DeepSeekV3 (dropless) 1,024 GPUs, GBS 8192, MBS 1, seq 4096, TP 2, PP 8, VP 4, EP 64,
  GA 128: 1,297. The same file, NeMo 25.11 container: LLAMA3_8B (FP8-CS, the same layout)
  14,451. Gradients reduced in bfloat16 (scripts/performance/configs/*/..._llm_pretrain.yaml
  at v0.1.0rc4: `grad_reduce_in_fp32: false`).
- NeMo Automodel (PyTorch FSDP2), DGX-H100, BF16 (NVIDIA-NeMo/Automodel performance summary,
  "System: DGX-H100, Precision: BF16"): DeepSeek V3 671B 1,024 GPUs, GBS 8192, MBS 1, LBS
  8, GA 4, seq 4096, PP 4, EP 64, VP 8, FSDP 256: 865 tokens/s/GPU; 256 GPUs, GBS 512, LBS 8,
  GA 1, PP 4, EP 64, VP 8, FSDP 64: 1,002.
- Megatron-Core v0.9 (NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md): Mixtral
  8x7B bf16 on 64 H100s, EP 8, PP 4, VP 8, GBS 256, seq 4096: 468 TFLOPS/GPU.
- NeMo 24.03 long-sequence table (docs/source/performance/performance_long_sequence.md):
  Llama 2 7B FP8, 131,072 tokens, 128 H100s, batch 32 (the table's "Batch Size" column,
  added 2025-04-28), TP 4, CP 4, DP 8: 555 TFLOPS/GPU (TFLOPS by Megatron's formula for
  Llama 2 7B: no GQA, FFN 11,008, a 32K vocabulary); four micro-batches of one sequence a
  replica (the micro-batch size is not published); gradients reduced in bfloat16 as the
  launcher's Llama 2 7B FP8 example of the same container (24.03.01:
  `optim.grad_sync_dtype=bf16`).
- DeepSeek-V3 Technical Report (arXiv 2412.19437, sections 1, 3.2 and 4.2): 180K H800 GPU
  hours per trillion tokens = 1,543 tokens/s/GPU on 2,048 H800s (FP8, DualPipe, PP 16, EP
  64, batch 15,360 sequences of 4,096; an average over pre-training, its batch ramp
  included); here 1,024 GPUs (expert-DP 1), DualPipeV over the same 120 micro-batches a
  pipeline with its all-to-alls overlapped, every RMSNorm and MLA up-projection recomputed
  (section 3.2.3), NVLink 160 GB/s (section 3.2.2).

Megatron rows split the model as Megatron does: the same number of layers a pipeline chunk
(`split: uniform`; the embedding with the first, the head and loss with the last), or the
recipe's own layout where it sets one (`stages`: Megatron-Bridge's 405B and DeepSeek-V3).
Settings every Megatron row takes (NeMo's and Megatron-Bridge's recipes) unless it says
otherwise: the distributed optimizer with overlapped gradient reduce-scatters and parameter
all-gathers, sequence parallelism and TP communication overlap (TransformerEngine's
userbuffers: `tp_comm_overlap`) with TP > 1, bfloat16 weights with gradients reduced in
bfloat16 (`precision`: the recipes' `grad_reduce_in_fp32: false`, `grad_sync_dtype=bf16`),
FP8 products where the row says FP8 (`precision.matmul: float8`: TransformerEngine's
recipe, modelled at the float8 peak's share; no FP8 kernel measured here). Megatron-FSDP
and FSDP2 rows shard with FSDP (`dp_shard`). The dense rows recompute nothing (the tables
do not say; where a prediction does not fit in 80 GB, the real run must have).

The MoE rows take what their recipes say (read in the frameworks' public sources):
- NeMo Automodel's DeepSeek-V3 (examples/benchmark/configs/deepseek_v3_te_deepep*.yaml,
  2025-10): DeepEP (`dispatcher: deepep`), balanced routing (`fake_balanced_gate`: uniform
  loads), every block recomputed (`activation_checkpointing: true`: `recompute: full`),
  FSDP units kept gathered from forward to backward (`reshard_after_forward: false`), and
  gradient accumulation as whole pipeline schedules (the recipe calls the pipeline's
  schedule once per accumulation step: `accumulation: 4` of 8 micro-batches at 1,024 GPUs),
  the shared expert on its own stream beside the routed path (`moe/layers.py`:
  `shared_expert_overlap`).
- Megatron-Bridge's DeepSeek-V3 on H100 (scripts/performance/run_script.py, v0.1.0rc4,
  2025-10): DeepEP, forced load balancing, `overlap_moe_expert_parallel_comm`
  (`ep_comm_overlap`), its recomputation of `mla_up_proj` and `mlp` (`recompute: modules`),
  no TP communication overlap (recipes/deepseek/deepseek_v3.py:
  `CommOverlapConfig(tp_comm_overlap=False)`; no userbuffers entry for it in
  scripts/performance/utils/helpers.py) and, on H100, `overlap_grad_reduce = False`.
  Its hand-placed layers (`Et|(tt|)*30mL`) as `stages` (MBRIDGE_DSV3_LAYOUT), its MTP
  module (`mtp_num_layers` 1 in recipes/deepseek/deepseek_v3.py: the `deepseek-v3-mtp1`
  trace) in the last chunk with the head and the loss. Not expressible here:
  `delay_wgrad_compute`, FP8 parameter gathers (`fp8_param_gather`).
- DeepSeek-V3's report: node-limited routing through NVLink forwarding (DeepEP) with FP8
  dispatch (`dispatch_dtype: float8`), 15,360 sequences over 128 data-parallel replicas:
  120 micro-batches a pipeline (here 7,680 over 64). DualPipe as DualPipeV (`schedule:
  dualpipev`: the same V of chunks, overlapped pairs and zero-bubble weight-gradient steps
  on one copy of the weights); its MTP module (section 2.2, depth 1: the
  `deepseek-v3-mtp1` trace) on the last stage.
- Group-limited routing (8 groups, 4 per token) comes with the shipped DeepSeek-V3 trace.

The system: DGX-H100 (8 H100 SXM per node, NVLink 450 GB/s per GPU and direction, one 400
Gb/s NIC per GPU), multi_node topology; the H800 rows NVLink 200 GB/s.

Run: PYTHONPATH=. python benchmarks/published_runs.py [--only NAME] [--skip-large]
Prints: published, predicted, ratio, peak memory per GPU, what the model leaves out; the
last line `N runs: median |error| X %, worst Y % (NAME)`.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces" / "modelled" / "h100-sxm"
MEGATRON = {"distributed_optimizer": True, "overlap_param_gather": True, "dp_overlap": True}
BF16 = {"params": "bfloat16", "reduce": "float32"}  # FSDP2's (Automodel) and Megatron-Core's
MEGATRON_BF16 = {"params": "bfloat16", "reduce": "bfloat16"}  # NeMo's and Bridge's recipes
FP8 = {**MEGATRON_BF16, "matmul": "float8"}
# NeMo Automodel's DeepSeek-V3 recipes (module docstring)
AUTOMODEL = {
    "dispatcher": "deepep",
    "recompute": "full",
    "reshard_after_forward": "never",
    "shared_expert_overlap": True,
}

# Megatron-Bridge's DeepSeek-V3 pipeline layout `Et|(tt|)*30mL` (32 chunks: the embedding
# and the first layer, thirty chunks of two layers, then the MTP module and the loss) as
# where chunks 2..32 begin in the trace (dense_layers.0-2, then layers.0-57); the last
# chunk holds the final norm, the output head, the MTP module and the losses
MBRIDGE_DSV3_LAYOUT = [
    "dense_layers.1",
    *(f"layers.{k}" for k in range(0, 58, 2)),
    "norm",
]
# Megatron-Bridge's Llama 3.1 405B recipe counts the embedding and the loss as layers
# (account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split: True in
# its recipes/llama/llama3.py, llama31_405b_pretrain_config, the performance scripts'
# base): 128 over
# 64 chunks, two a chunk: the embedding and layers.0, then two layers a chunk, then
# layers.125 and the loss
MBRIDGE_405B_LAYOUT = [f"layers.{k}" for k in range(1, 126, 2)]
RUNS = [
    # name, trace, GPUs, global batch (sequences), tokens per sequence, mesh fields,
    # precision, published (value, unit), source, NVLink per direction
    ("NeMo 24.07 Llama 3 8B, 8 GPUs, CP 2 (FP8)", "llama3-8b-s8192-b1", 8, 128, 8192,
     {"cp": 2, "microbatches": 32, **MEGATRON}, FP8, (12273, "tokens"), "NeMo 24.07", 450e9),
    ("NeMo 24.07 Llama 3 70B, 64 GPUs, TP 4 PP 4 CP 2 VP 5 (FP8)", "llama3-70b-s8192-b1", 64,
     128, 8192, {"tp": 4, "pp": 4, "cp": 2, "virtual_stages": 5, "schedule": "interleaved",
                 "microbatches": 64, "sequence_parallel": True, "split": "uniform",
                 **MEGATRON},
     FP8, (1524, "tokens"), "NeMo 24.07", 450e9),
    ("MBridge 25.09 Llama 3 8B, 8 GPUs, FSDP (FP8)", "llama3-8b-s8192-b1", 8, 128, 8192,
     {"dp_shard": 8, "microbatches": 16}, FP8, (14079, "tokens"), "Megatron-Bridge 25.09",
     450e9),
    ("MBridge 25.11 Llama 3 8B, 8 GPUs, FSDP (FP8)", "llama3-8b-s8192-b1", 8, 128, 8192,
     {"dp_shard": 8, "microbatches": 16}, FP8, (14451, "tokens"), "Megatron-Bridge 25.11",
     450e9),
    ("MBridge 25.09 Llama 3 70B, 64 GPUs, TP 4 PP 8 VP 5 (FP8)", "llama3-70b-s8192-b1", 64,
     128, 8192, {"tp": 4, "pp": 8, "virtual_stages": 5, "schedule": "interleaved",
                 "microbatches": 64, "sequence_parallel": True, "split": "uniform",
                 **MEGATRON},
     FP8, (1619, "tokens"), "Megatron-Bridge 25.09", 450e9),
    ("MBridge 25.09 Llama 3.1 405B, 1,024 GPUs, TP 8 PP 8 CP 2 VP 8 (FP8)",
     "llama3.1-405b-s8192-b1", 1024, 512, 8192,
     {"tp": 8, "pp": 8, "cp": 2, "virtual_stages": 8, "schedule": "interleaved",
      "microbatches": 64, "sequence_parallel": True, "stages": MBRIDGE_405B_LAYOUT,
      **MEGATRON},
     FP8, (302, "tokens"), "Megatron-Bridge 25.09", 450e9),
    ("MBridge 25.09 DeepSeek-V3, 1,024 GPUs, TP 2 PP 8 VP 4 EP 64 (FP8)",
     "deepseek-v3-mtp1-s4096-b1", 1024, 8192, 4096,
     {"tp": 2, "pp": 8, "virtual_stages": 4, "schedule": "interleaved", "ep": 64,
      "microbatches": 128, "sequence_parallel": True, "dispatcher": "deepep",
      "ep_comm_overlap": True, "recompute": "modules",
      "recompute_modules": ["mla_up_proj", "mlp"], "stages": MBRIDGE_DSV3_LAYOUT, **MEGATRON,
      "tp_comm_overlap": False, "dp_overlap": False},
     FP8, (1297, "tokens"), "Megatron-Bridge 25.09", 450e9),
    ("Automodel DeepSeek-V3, 1,024 GPUs, PP 4 VP 8 EP 64 FSDP (BF16)", "deepseek-v3-s4096-b1",
     1024, 8192, 4096, {"pp": 4, "virtual_stages": 8, "schedule": "interleaved", "ep": 64,
                        "dp_shard": 256, "microbatches": 32, "accumulation": 4, **AUTOMODEL},
     BF16, (865, "tokens"), "NeMo Automodel", 450e9),
    ("Automodel DeepSeek-V3, 256 GPUs, PP 4 VP 8 EP 64 FSDP (BF16)", "deepseek-v3-s4096-b1",
     256, 512, 4096, {"pp": 4, "virtual_stages": 8, "schedule": "interleaved", "ep": 64,
                      "dp_shard": 64, "microbatches": 8, **AUTOMODEL},
     BF16, (1002, "tokens"), "NeMo Automodel", 450e9),
    ("MCore 0.9 Mixtral 8x7B, 64 GPUs, EP 8 PP 4 VP 8 (BF16)", "mixtral-8x7b-s4096-b1", 64,
     256, 4096, {"ep": 8, "pp": 4, "virtual_stages": 8, "schedule": "interleaved",
                 "microbatches": 16, "split": "uniform", **MEGATRON},
     BF16, (468, "tflops"), "Megatron-Core v0.9 MoE README", 450e9),
    ("NeMo 24.03 Llama 2 7B 128K, 128 GPUs, TP 4 CP 4 (FP8)",
     "llama2-7b-s131072-b1", 128, 32, 131072,
     {"tp": 4, "cp": 4, "microbatches": 4, "sequence_parallel": True, **MEGATRON,
      "overlap_param_gather": False},
     FP8, (555, "megatron_tflops"), "NeMo 24.03 long sequence", 450e9),
    ("DeepSeek-V3 report, 2,048 H800 (here 1,024), PP 16 EP 64 (FP8, DualPipe)",
     "deepseek-v3-mtp1-s4096-b1", 1024, 7680, 4096,
     {"pp": 16, "ep": 64, "microbatches": 120, "distributed_optimizer": True,
      "dispatcher": "deepep", "dispatch_dtype": "float8", "schedule": "dualpipev",
      "virtual_stages": 2, "ep_comm_overlap": True, "recompute": "modules",
      "recompute_modules": ["layernorm", "mla_up_proj"]},
     FP8, (1e12 / (180e3 * 3600), "tokens"), "DeepSeek-V3 report", 160e9),
]  # fmt: skip

LARGE = 512  # --skip-large leaves out rows on more GPUs
PERFMODEL = "learned"  # --perfmodel
# the runs of Megatron-Core's frameworks run TransformerEngine's modules (its default
# transformer implementation): fused norms, RoPE, SwiGLU and attention keep what
# triosim/results/fused_saves.py says (memory.activations: fused)
TE_RUNS = ("NeMo", "MBridge", "MCore")


def config(run) -> dict:
    name, trace, gpus, batch, seq, mesh, precision, _, _, nvlink = run
    if mesh.get("distributed_optimizer"):  # Megatron's data parallelism: replicas
        model = mesh.get("tp", 1) * mesh.get("pp", 1) * mesh.get("cp", 1)
        mesh = {**mesh, "dp_replicate": gpus // model, "dp_shard": 1}
        if mesh.get("tp", 1) > 1:  # NeMo's H100 recipes: TP communication overlap
            mesh.setdefault("tp_comm_overlap", True)
    return {
        "trace": str(TRACES / f"{trace}.trace.json.gz"),
        "num_gpus": gpus,
        "batch_size": batch,
        "gpu": "H100-SXM",
        "perfmodel": {"kind": PERFMODEL},
        "symmetry": "auto",
        "precision": precision,
        "parallelism": {"mode": "mesh", **mesh},
        "memory": {"activations": "fused" if name.startswith(TE_RUNS) else "trace"},
        "topology": {
            "kind": "multi_node",
            "gpus_per_node": 8,
            "bandwidth": nvlink,
            "latency": 1e-6,
            "inter_bandwidth": 50e9,
            "inter_latency": 5e-6,
        },
    }


def predicted(run, r, sim) -> float:
    """The row's metric at the predicted iteration time."""
    _, _, gpus, batch, seq, _, _, (_, unit), _, _ = run
    if unit == "tokens":
        return batch * seq / gpus / r.iteration_time
    if unit == "megatron_tflops":  # Llama 2 7B's model FLOPs, as NeMo counts them
        from benchmarks.llm_parallelism import megatron_flops

        flops = megatron_flops(s=seq, L=32, h=4096, H=32, g=32, f=11008, V=32000)
    else:  # the trace's forward and backward FLOPs per sequence
        ops = sim.trace.operators
        flops = sum(o.flops or 0.0 for o in ops if o.phase in ("forward", "backward"))
    return flops * batch / gpus / r.iteration_time / 1e12


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="rows whose name contains this")
    ap.add_argument("--skip-large", action="store_true", help=f"rows on at most {LARGE} GPUs")
    ap.add_argument("--perfmodel", default=PERFMODEL, help="the operator model (default: learned)")
    a = ap.parse_args(argv)
    globals()["PERFMODEL"] = a.perfmodel
    from triosim import Simulation

    rows = [r for r in RUNS if a.only is None or a.only in r[0]]
    if a.skip_large:
        rows = [r for r in rows if r[2] <= LARGE]
    print("| run | GPUs | published | predicted | ratio | peak GB | wall s |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for run in rows:
        name, (value, unit) = run[0], run[7]
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sim = Simulation(config(run))
            r = sim.run()
        got = predicted(run, r, sim)
        ratio = got / value
        errors.append((abs(ratio - 1), name))
        what = "TFLOPS/GPU" if "tflops" in unit else "tokens/s/GPU"
        peak = max(r.peak_memory.values()) / 1e9
        print(
            f"| {name} | {run[2]:,} | {value:,.0f} {what} | {got:,.0f} | {ratio:.2f} | "
            f"{peak:.1f} | {time.perf_counter() - t0:.1f} |",
            flush=True,
        )
    med = statistics.median(e for e, _ in errors)
    worst, who = max(errors)
    print(
        f"{len(errors)} runs: median |error| {100 * med:.1f} %, worst {100 * worst:.1f} % ({who})"
    )


if __name__ == "__main__":
    main()
