#!/usr/bin/env bash
# The H200 run recorded in docs/benchmarks.md ("Tree attention"): parity, then the benchmark, two GPUs in
# parallel, every step under its own time limit; logs and JSON go to $OUT (default ./out).
# No uv there: the packages run from the source tree on PYTHONPATH (their __version__ reads "0+source").
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export PYTHONPATH=packages/agrpo-packing/src:packages/agrpo-attention/src:.
bench="python3 -m tools.bench.tree_attention"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 110 python3 -m tools.bench.tree_attention.parity --backends cascade,varlen,flex --shapes qwen3-1.7b \
    --no-hybrid 2>&1 | tee "$OUT/parity.log"
  timeout 230 $bench --models qwen3-1.7b --repeats 2 --json "$OUT/bench_1.7b.json" 2>&1 | tee "$OUT/bench_1.7b.log"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 $bench --models qwen3-0.6b --repeats 2 --json "$OUT/bench_0.6b.json" 2>&1 | tee "$OUT/bench_0.6b.log"
  timeout 170 $bench --models qwen3.5-hybrid-2b --layers 8 --budget 8192 --ratios 1,3.4,8 --tree-backends cascade \
    --deltanet-kernel torch --repeats 1 --json "$OUT/bench_hybrid.json" 2>&1 | tee "$OUT/bench_hybrid.log"
) &
wait
