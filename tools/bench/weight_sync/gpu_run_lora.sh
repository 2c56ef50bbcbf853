#!/usr/bin/env bash
# LoRA r=32 adapter sync on a 4B-shaped model, one GPU (the stub receiver on the same GPU). Run 1: the default
# (files in the server's dtype, bfloat16) alone, `ITERS1` versions, in a fresh process (its first version
# cold). Run 2: the pinned staging against the per-tensor pageable copy it replaced, each in its own process,
# for `DTYPES` (auto = the server's dtype; float32 = what PEFT keeps), files under a temporary dir on the root
# disk and under /dev/shm. Logs and JSON in $OUT.
set -o pipefail
source tools/bench/train_step/gpu_env.sh
df -h /tmp /dev/shm | tee "$OUT/lora_fs.txt"
timeout ${TL:-150} python3 -m tools.bench.weight_sync --lora-only --single-gpu --iters ${ITERS1:-20} \
  --json "$OUT/lora_default.json" 2>&1 | grep -v Warning | tee "$OUT/lora_default.log"
for staging in ${STAGINGS:-pinned pageable}; do
  timeout ${TL:-150} python3 -m tools.bench.weight_sync --lora-only --single-gpu --iters ${ITERS:-10} \
    --lora-dtypes ${DTYPES:-auto,float32} --lora-dirs tmp,/dev/shm --lora-staging $staging \
    --json "$OUT/lora_$staging.json" 2>&1 | grep -v Warning | tee "$OUT/lora_$staging.log"
done
