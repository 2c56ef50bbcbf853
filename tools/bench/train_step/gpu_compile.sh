#!/usr/bin/env bash
# Issue 20 ("the policy step compiled") on one H200: compiled decoder layers against today's eager step.
# Run from the repository root: `OUT=<dir> bash tools/bench/train_step/gpu_compile.sh` (logs and JSON under $OUT,
# default /tmp/gpu_compile). No uv there: the packages run from the source tree on PYTHONPATH; SITE=<dir> adds a
# directory of unpacked wheels (msgspec, prometheus_client), or wheels in .whl/ are installed into /tmp/site.
# The whole run ends within 9 minutes: every step has its own time limit, cut to what is left of a 510 s budget,
# and steps run most important first (compile time counts; inductor's on-disk cache is shared by later steps;
# each step's JSON is written after every ratio, so a step cut by its limit keeps what it measured):
#  A. 1.7B amp, layers compiled, selective checkpointing, ratios 1/3.4/8, tree + plain: MFU, tok/s, the loss
#     and gradients against the same regions eager (--parity), graphs compiled, then 20 steps of fresh rows of
#     varying sizes (--recompile-steps: new graphs should be 0), recompile reasons (TORCH_LOGS=recompiles);
#  B. today's eager step (transformers' checkpointing, no regions), ratios 1/3.4/8: the 1.5x baseline;
#  E. the bf16 weight cast once per step, eager regions (full checkpointing) with and without it, ratio 1 tree,
#     and one cast of all layer weights timed (--cast-probe);
#  C. compiled, checkpointing auto (1.7B fits without: expect "none"), the choice logged, GPU idle and the busy
#     time by kernel kind for every row (--idle inline);
#  D. 4B amp compiled selective, ratio 1, 2 prompts;
#  G. compiled full checkpointing, ratio 1;
#  then a summary of the targets from the JSON files (compile_summary.py).
# BENCH_EXTRA="--tiny" runs every step on CPU with tiny shapes (a smoke test of this script's commands).
set -o pipefail
OUT=${OUT:-/tmp/gpu_compile}
source tools/bench/train_step/gpu_env.sh
BUDGET=${BUDGET:-510}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h %cd' 2>/dev/null; date -u; } | tee "$OUT/gpu.txt"

common="--models qwen3-1.7b --prompts 4 --precision amp"
step A_compiled_selective 210 $common --compile on --checkpointing selective --ratios 1,3.4,8 --parity \
  --recompile-steps 20
step B_eager_today 75 $common --compile off --checkpointing on --ratios 1,3.4,8 --steps 1
step E_weight_cast_eager 50 $common --compile off --checkpointing full --cast-weights on,off --ratios 1 \
  --kinds tree --steps 1 --cast-probe
step C_compiled_auto 110 $common --compile on --checkpointing auto --ratios 1,3.4,8 --idle inline
step D_4b_compiled_selective 85 --models qwen3-4b --prompts 2 --precision amp --compile on \
  --checkpointing selective --ratios 1
step G_compiled_full 60 $common --compile on --checkpointing full --ratios 1
$PY -m tools.bench.train_step.compile_summary "$OUT" 2>&1 | tee "$OUT/summary.txt"
echo "total $(($(date +%s) - START))s"
