#!/usr/bin/env bash
# How the shipped modelled traces were made: shape-only traces (the model on meta tensors,
# nothing computed) timed by the calibrated operator model (perfmodel/calibration/h100.json,
# fitted on the original TrioSim's H100 traces). Their times are MODELLED, not measured.
# A100 and A40 times use those H100-fitted efficiencies with the A100's and A40's catalogue
# peaks and bandwidths (an assumption). Kernel counts per operator name come from the real
# H100 traces (perfmodel/kernel_counts.py; after a new table, `python -m
# perfmodel.kernel_counts --recount traces/modelled/*/*.trace.json.gz` updates them without
# tracing again). Re-run from the repository root:
#   bash traces/make_modelled_traces.sh
set -euo pipefail
trace() { python -m triosim.cli.main trace "$@" --shapes-only --calibration perfmodel/calibration/h100.json; }
for gpu in A100-80GB A40; do
  out="traces/modelled/$(echo "$gpu" | tr '[:upper:]' '[:lower:]')"
  trace vgg11 --batch-size 128 --gpu "$gpu" --out "$out"
  trace vgg19 --batch-size 64 --gpu "$gpu" --out "$out"
  trace resnet50 --batch-size 128 --gpu "$gpu" --out "$out"
  trace densenet121 --batch-size 64 --gpu "$gpu" --out "$out"
  trace gpt2 --seq-len 512 --batch-size 8 --gpu "$gpu" --out "$out"
done
# Llama 3.2 1B: 2 of its 16 identical layers traced at full width, replicated to 16
trace llama3.2-1b --seq-len 2048 --batch-size 1 --layers 2 --gpu A100-80GB --out traces/modelled/a100-80gb
# for the examples: Llama 3 8B on H100 (2 of 32 layers traced), as torchtitan trains it
# (float32 parameters cast to bfloat16 where used) and as Megatron-LM does (bfloat16
# parameters, float32 master weights in the optimizer: tensor parallelism shards the weights
# the matrix products read); ResNet-50 on H100 (beside the real H100 trace it was fitted on)
trace llama3-8b --seq-len 2048 --batch-size 8 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
trace llama3-8b --seq-len 2048 --batch-size 8 --layers 2 --gpu H100-SXM --master-weights --out traces/modelled/h100-sxm
trace resnet50 --batch-size 128 --gpu H100-SXM --out traces/modelled/h100-sxm
trace llama3-8b --seq-len 131072 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
# Llama 2 7B at 128K, as NeMo's long-sequence table trained it (its published row)
trace llama2-7b --seq-len 131072 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
# mixture of experts (tracer/moe.py): Mixtral 8x7B and DeepSeek-V3, 2 of their MoE layers
# traced (DeepSeek-V3's 3 dense layers whole) and replicated, dropless routing traced at the
# balanced load; for mode ep and benchmarks/llm_parallelism.py
trace mixtral-8x7b --seq-len 4096 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
trace deepseek-v3 --seq-len 4096 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
# DeepSeek-V3 with its multi-token prediction module (the report's training; Megatron-Bridge's
# recipe: mtp_num_layers 1), for the published runs that trained with it
trace deepseek-v3 --seq-len 4096 --batch-size 1 --layers 2 --mtp 1 --gpu H100-SXM --out traces/modelled/h100-sxm
# the mesh's published layouts (examples/titan_*.yaml): torchtitan's Llama 3.1 8B, 70B and
# 405B at sequence 8192 (the 8B and 70B have Llama 3's shapes), 405B at 64K for CP
trace llama3-8b --seq-len 8192 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
trace llama3-70b --seq-len 8192 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
trace llama3.1-405b --seq-len 8192 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
trace llama3.1-405b --seq-len 65536 --batch-size 1 --layers 2 --gpu H100-SXM --out traces/modelled/h100-sxm
