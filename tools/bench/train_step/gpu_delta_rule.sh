#!/usr/bin/env bash
# Issue 21 on one H200, second round: agrpo's fused Triton delta rule and Triton path convolution, then the
# hybrid train step. Run from the repository root: `OUT=<dir> bash tools/bench/train_step/gpu_delta_rule.sh`
# (results under $OUT, default /tmp/gpu_delta_rule). No uv there: the packages run from the source tree on
# PYTHONPATH; SITE=<dir> adds a directory of unpacked wheels (msgspec, prometheus_client, as for gpu_run.sh),
# or wheels in .whl/ are installed into /tmp/site. Every step has its own time limit; about 4 minutes in all.
#  a. delta_rule_kernels with the launch table in the code (4 warps; 8 for wy_backward and dqk_backward):
#     full-size parity (delta rule values and gradients, bf16 inputs and fp32, and the path convolution,
#     against PyTorch in fp64) and, for the first tree and the first plain row at ratios 1 and 3.4, ms per
#     layer per 16k tokens: the delta rule split into kernel time and everything else, the path convolution
#     (Triton and PyTorch), the whole layer, each kernel;
#  b. only when a fails parity: the all-4-warp table of the first round (w4), parity and time, ratio 1;
#  c. the train step (`qwen3.5-hybrid-2b`, amp, checkpointing on, 2 prompts, ratios 1 and 3.4) under the
#     fastest launch table that passed parity (delta_rule_launch): step time, MFU, tree/plain MFU, and the
#     delta rule's and the convolution's shares of the step.
set -o pipefail
OUT=${OUT:-/tmp/gpu_delta_rule}
source tools/bench/train_step/gpu_env.sh
kernels="python3 -m tools.bench.train_step.delta_rule_kernels"
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"

passed() {  # every ratio of a delta_rule_kernels JSON passed parity
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['results']; sys.exit(not (r and all(x['passed'] for x in r)))" "$1" 2>/dev/null
}

timeout ${T_KERNELS:-110} $kernels --ratios 1,3.4 --json "$OUT/kernels_default.json" 2>&1 | tee "$OUT/kernels_default.log"
if ! passed "$OUT/kernels_default.json"; then
  timeout ${T_SWEEP:-45} $kernels --quick --ratios 1 --launch w4 --json "$OUT/kernels_w4.json" 2>&1 | tee "$OUT/kernels_w4.log"
fi
timeout ${T_STEP:-110} python3 -m tools.bench.train_step.delta_rule_launch --from "$OUT/kernels_default.json" "$OUT/kernels_w4.json" -- \
  --models qwen3.5-hybrid-2b --prompts 2 --checkpointing on --ratios 1,3.4 --deltanet-kernel triton \
  --json "$OUT/train_step_hybrid.json" 2>&1 | tee "$OUT/train_step_hybrid.log"

echo "== summary ($OUT)"
grep -h -E "^delta_rule_kernels|^ratio|parity (PASS|FAIL)|ms per layer|triton kernels|^delta rule launch|^no launch" \
  "$OUT"/kernels_default.log "$OUT"/kernels_w4.log "$OUT"/train_step_hybrid.log 2>/dev/null
grep -h -E "^qwen3.5|^  (tree|plain) |tree/plain|^shares" "$OUT"/train_step_hybrid.log 2>/dev/null
