#!/usr/bin/env bash
# The H200 run recorded in docs/benchmarks.md ("Train step"): every configuration under its own time limit;
# logs and JSON go to $OUT (default ./out). No uv there: the packages run from the source tree on PYTHONPATH.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
PKG=${PKG:-packages}  # another checkout's packages/ may be measured instead
export PYTHONPATH=${SITE:+$SITE:}$PKG/agrpo-packing/src:$PKG/agrpo-attention/src:$PKG/agrpo-rollout/src:$PKG/agrpo-sync/src:$PKG/agrpo-trainer/src:.
bench="python3 -m tools.bench.train_step"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 $bench --models qwen3-1.7b --prompts ${PROMPTS:-4} --checkpointing on,off --idle \
  --json "$OUT/train_step_1.7b_amp.json" 2>&1 | tee "$OUT/train_step_1.7b_amp.log"
timeout 120 $bench --models qwen3-1.7b --prompts ${PROMPTS:-4} --checkpointing on --precision bf16 \
  --json "$OUT/train_step_1.7b_bf16.json" 2>&1 | tee "$OUT/train_step_1.7b_bf16.log"
timeout 150 $bench --models qwen3-4b --prompts 2 --checkpointing on \
  --json "$OUT/train_step_4b_amp.json" 2>&1 | tee "$OUT/train_step_4b_amp.log"
