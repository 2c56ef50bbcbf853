# Sourced on the GPU machine before a benchmark run there (no uv; every gpu_*.sh sources it): wheels carried in
# .whl are installed into /tmp/site unless SITE names a directory of unpacked wheels already, and the packages
# run from the source tree on PYTHONPATH (PKG=<dir> measures another checkout's packages/). NVLink multicast
# stays off. Results go under $OUT (default ./out).
if [ -z "${SITE:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  SITE=/tmp/site
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
P=${PKG:-packages}
export PYTHONPATH=${SITE:+$SITE:}$P/agrpo-packing/src:$P/agrpo-attention/src:$P/agrpo-rollout/src:$P/agrpo-sync/src:$P/agrpo-trainer/src:.
OUT=${OUT:-out}; mkdir -p "$OUT"
