#!/usr/bin/env bash
# The H200 run recorded in docs/benchmarks.md ("Train step"): every configuration under its own time limit;
# logs and JSON go to $OUT (default ./out). No uv there: the packages run from the source tree on PYTHONPATH.
# 1. 1.7B amp + checkpointing, fused LM head, GPU idle with the rows prefetched and sequentially (--idle);
# 2. the same with the LM head unfused; 3. the Gated DeltaNet hybrid shape (PyTorch delta rule), 2 prompts.
set -o pipefail
source tools/bench/train_step/gpu_env.sh
bench="python3 -m tools.bench.train_step"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${T1:-270} $bench --models qwen3-1.7b --prompts ${PROMPTS:-4} --checkpointing on --idle \
  --json "$OUT/train_step_1.7b_fused.json" 2>&1 | tee "$OUT/train_step_1.7b_fused.log"
timeout ${T2:-120} $bench --models qwen3-1.7b --prompts ${PROMPTS:-4} --checkpointing on --ratios 1,3.4 \
  --head unfused --json "$OUT/train_step_1.7b_unfused.json" 2>&1 | tee "$OUT/train_step_1.7b_unfused.log"
timeout ${T3:-180} $bench --models qwen3.5-hybrid-2b --prompts 2 --checkpointing on --ratios 1,3.4 \
  --json "$OUT/train_step_hybrid.json" 2>&1 | tee "$OUT/train_step_hybrid.log"
