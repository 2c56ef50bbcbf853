#!/usr/bin/env bash
# Issue 32 point 3 on one H200: the hybrid's Gated DeltaNet layers compiled like dense ones (agrpo's Triton delta
# rule and path convolution run as custom ops inside the layer's graph; no graph break, checked on CPU by
# packages/agrpo-trainer/tests/test_layer_region.py) against the eager step of issue 21. Run from the repository
# root: `OUT=<dir> bash tools/bench/train_step/gpu_hybrid_compile.sh` (logs and JSON under $OUT, default
# /tmp/gpu_hybrid_compile). No uv there: the packages run from the source tree on PYTHONPATH (gpu_env.sh). The
# whole run ends within 9 minutes (a 530 s budget; each step cut to what is left), most important first:
#  A. qwen3.5-hybrid-2b amp, every layer compiled (inductor), full checkpointing ("checkpointing on"), ratios
#     1 / 3.4, tree + plain: MFU (target >= 30% at ratio 1, tree/plain >= 0.95 at 3.4), the loss and gradients
#     against the same regions eager and fp32 (--parity: the parity rule), graphs and graph breaks (expect 0
#     breaks), then 10 steps of fresh rows (new graphs should be 0);
#  B. today's eager step (transformers' checkpointing, Gated DeltaNet eager): the baseline on this GPU
#     (2026-12-03: 19.8% / 18.8% MFU tree at ratios 1 / 3.4; issue 32 quotes 21.8%, 0.93x);
#  C. compiled, selective checkpointing, ratios 1 / 3.4;
#  then compile_summary.py over every JSON (its targets are issue 20's; read MFU and tree/plain against the above).
# BENCH_EXTRA="--tiny" runs the commands on CPU with tiny shapes (a smoke test of this script).
set -o pipefail
OUT=${OUT:-/tmp/gpu_hybrid_compile}
source tools/bench/train_step/gpu_env.sh
BUDGET=${BUDGET:-530}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h %cd' 2>/dev/null; date -u; } | tee "$OUT/gpu.txt"

common="--models qwen3.5-hybrid-2b --prompts 2 --precision amp --deltanet-kernel ${KERNEL:-triton} --ratios 1,3.4"
step A_hybrid_compiled_full 250 $common --compile on --checkpointing full --parity --recompile-steps 10
step B_hybrid_eager_today 110 $common --compile off --checkpointing on
step C_hybrid_compiled_selective 150 $common --compile on --checkpointing selective
$PY -m tools.bench.train_step.compile_summary "$OUT" 2>&1 | tee "$OUT/summary.txt"
echo "total $(($(date +%s) - START))s"
