# Sourced on the GPU machine before a benchmark run there (no uv; every gpu_*.sh sources it): wheels carried in
# .whl are installed into /tmp/site unless SITE names a directory of unpacked wheels already, and the packages
# run from the source tree on PYTHONPATH (PKG=<dir> measures another checkout's packages/). NVLink multicast
# stays off. Results go under $OUT (default ./out). `step` runs the train-step bench within a shared time budget.
if [ -z "${SITE:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  SITE=/tmp/site
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
P=${PKG:-packages}
export PYTHONPATH=${SITE:+$SITE:}$P/agrpo-packing/src:$P/agrpo-attention/src:$P/agrpo-rollout/src:$P/agrpo-sync/src:$P/agrpo-trainer/src:.
OUT=${OUT:-out}; mkdir -p "$OUT"
PY=${PY:-python3}
START=$(date +%s)

step() {  # step NAME LIMIT_S ARGS...: one train-step bench run under min(LIMIT_S, what is left of $BUDGET s),
  # its log and JSON in $OUT (TORCH_LOGS_STEP: dynamo's logs, default recompile reasons; BENCH_EXTRA: more args)
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 40 ]; then echo "== $name skipped: ${left}s left" | tee -a "$OUT/skipped.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  TORCH_LOGS=${TORCH_LOGS_STEP:-recompiles} timeout --kill-after=10 "$limit" $PY -m tools.bench.train_step \
    ${BENCH_EXTRA:-} "$@" --json "$OUT/$name.json" 2>&1 | grep -v '^DEBUG' | tee -a "$OUT/$name.log"
  echo "== $name exit ${PIPESTATUS[0]} after $(($(date +%s) - START))s" | tee -a "$OUT/$name.log"
}
