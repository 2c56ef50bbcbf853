#!/usr/bin/env bash
# Compiled regions' gradients against eager regions and an fp32 step, by compile backend and checkpointing mode:
# one 4-layer Qwen3-1.7B shape, ratios 1 and 3.4 (varlen and flex rows). Written when the H200 run of
# gpu_compile.sh read compiled 3.8x further from fp32 than eager bf16; this sweep traced it to the weights cast
# once being handed to compiled regions (every mode and backend failed with them, passed without), which compiled
# layers no longer take. `OUT=<dir> bash tools/bench/train_step/gpu_parity.sh` (about 7 minutes on one H200).
set -o pipefail
OUT=${OUT:-/tmp/gpu_parity}
source tools/bench/train_step/gpu_env.sh
BUDGET=${BUDGET:-500}
common="--models qwen3-1.7b --layers 4 --prompts 4 --precision amp --compile on --ratios 1,3.4 --kinds tree --parity --steps 1"
step inductor_selective 120 $common --checkpointing selective
step aot_eager_selective 70 $common --checkpointing selective --compile-backend aot_eager
step inductor_none 100 $common --checkpointing none
step aot_eager_none 60 $common --checkpointing none --compile-backend aot_eager
step inductor_full 100 $common --checkpointing full
grep -hE "^== |parity|by layer" "$OUT"/*.log | tee "$OUT/summary.txt"
