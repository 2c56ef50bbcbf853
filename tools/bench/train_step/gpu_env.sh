# Sourced on the GPU machine before a benchmark run there (no uv): wheels carried in .whl are installed
# into /tmp/site, and the packages run from the source tree on PYTHONPATH. NVLink multicast stays off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TOKENIZERS_PARALLELISM=false
P=packages
export PYTHONPATH=/tmp/site:$P/agrpo-packing/src:$P/agrpo-attention/src:$P/agrpo-rollout/src:$P/agrpo-sync/src:$P/agrpo-trainer/src:.
OUT=${OUT:-out}; mkdir -p "$OUT"
