#!/usr/bin/env bash
# The compiled step on one H200 (issues 20 and 31): what `torch_compile` on by default rests on, and where it stands.
# Run from the repository root: `OUT=<dir> bash tools/bench/train_step/gpu_compile.sh` (logs and JSON under $OUT,
# default /tmp/gpu_compile), with the msgspec / prometheus_client wheels in .whl/ (see gpu_env.sh). The whole run
# ends within 9 minutes: each step has its own time limit, cut to what is left of a 540 s budget, most important
# first (inductor's on-disk cache is shared by later steps; JSON is written as each step goes):
#  T. the trainer's own train() over the recorded CPU-server rollouts (trainer_run.py): compile on by default,
#     full fine-tuning and LoRA, 22 steps, graphs and graph breaks, parity against fp32;
#  A. 1.7B amp, compiled, selective checkpointing, ratios 1/3.4/8, tree + plain: MFU, tok/s, the GPU's busy time
#     by kernel (--idle inline), then compiled cascade tree rows at 3.4/8 (the tree attention that is FA2 blocks);
#  L. long rows: 4B with 64k- and 32k-token rows under checkpointing auto (the mode mix, peak memory, MFU);
#  N. compiled without checkpointing, ratio 1 (what auto picks where it fits).
# BENCH_EXTRA="--tiny" runs every bench step on CPU with tiny shapes (a smoke test of this script's commands).
set -o pipefail
OUT=${OUT:-/tmp/gpu_compile}
source tools/bench/train_step/gpu_env.sh
BUDGET=${BUDGET:-540}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='commit %h %cd' 2>/dev/null; date -u; } | tee "$OUT/gpu.txt"

if [ "${STEP_T:-on}" = on ]; then  # STEP_T=off: step T ran in an earlier call
  timeout --kill-after=10 330 $PY -m tools.bench.train_step.trainer_run --model qwen3-1.7b --lora both --steps 22 \
    ${TRAINER_EXTRA:-} --json "$OUT/T_trainer_run.json" 2>&1 | grep -v '^DEBUG\|^[VIW]1[0-9]' | tee "$OUT/T_trainer_run.log"
fi
common="--models qwen3-1.7b --prompts 4 --precision amp --compile on"
step A_selective 150 $common --checkpointing selective --ratios 1,3.4,8 --idle inline
step A_cascade 90 $common --checkpointing selective --backend cascade --ratios 3.4,8 --kinds tree
step L_4b_64k 130 --models qwen3-4b --budget 65536 --prompts 16 --precision amp --compile on --checkpointing auto \
  --ratios 3.4 --kinds tree --steps 1
step L_4b_32k 80 --models qwen3-4b --budget 32768 --prompts 8 --precision amp --compile on --checkpointing auto \
  --ratios 3.4 --kinds tree --steps 1
step N_none 70 $common --checkpointing none --ratios 1
$PY -m tools.bench.train_step.compile_summary "$OUT" 2>&1 | tee "$OUT/summary.txt"
echo "total $(($(date +%s) - START))s"
