#!/usr/bin/env bash
# How the shipped CPU traces were made (torch 2.13.0 CPU build, 2-core machine, Adam, fp32;
# each records its measured peak memory, read by benchmarks/memory_accuracy.py).
# Re-run from the repository root to regenerate them: bash traces/make_cpu_traces.sh
set -euo pipefail
for b in 4 8 16; do
  python -m triosim.cli.main trace resnet18 --batch-size "$b" --device cpu --out traces/cpu --warmup 3 --measure 5
  python -m triosim.cli.main trace gpt2 --small --seq-len 128 --batch-size "$b" --device cpu --out traces/cpu --warmup 3 --measure 5
done
