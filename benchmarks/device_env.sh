# Sourced by gpu_suite.sh and multigpu_suite.sh on the device machine (repo root): NVLink multicast
# off (a program that uses it can take the host's GPUs out of service), carried wheels installed,
# the repo on PYTHONPATH, $OUT created.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
