#!/usr/bin/env bash
# One call on the GPU machine: environment, GPU tests, benchmarks; logs and JSON under $OUT, then the
# short table of results and targets (suite_summary.py).
# Usage (device machine, repo root): bash benchmarks/gpu_suite.sh [tests|bench|all] [extra pytest -k expr]
set -u
what=${1:-all}
kexpr=${2:-}
source benchmarks/device_env.sh  # multicast off, wheels, PYTHONPATH, $OUT
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, triton, subprocess
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} triton {triton.__version__} cuda {torch.version.cuda} gpus {torch.cuda.device_count()} "
      f"{p.name} cc{p.major}.{p.minor} sms {p.multi_processor_count}")
print(subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
PY
if [ "$what" = tests ] || [ "$what" = all ]; then
  if [ -n "$kexpr" ]; then
    timeout ${SUITE_TIMEOUT:-480} python3 -m pytest -q -m gpu --timeout=${TEST_TIMEOUT:-90} ${GPU_TEST_DIRS:-tests/kernels tests/model tests/engine tests/comm tests/spec} -x -k "$kexpr" -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  else
    timeout ${SUITE_TIMEOUT:-480} python3 -m pytest -q -m gpu --timeout=${TEST_TIMEOUT:-90} ${GPU_TEST_DIRS:-tests/kernels tests/model tests/engine tests/comm tests/spec} -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  fi
fi
# Arguments each benchmark gets here: sized so that one call of the device tool (10 min) runs several.
bench_args() {
  case "$1" in
    decode) echo "--hf-tokens 128" ;;
    spec_decode) echo "--concurrency 1,4,16,32,64,128 --tokens 192" ;;
    serve_bench) echo "--single-tokens 1024 --concurrency 1,8,32,64,128,256 --repeats 2" ;;
    tp_decode) echo "--models llama-3.1-8b --tp-sizes 1,2 --modes fused" ;;
    comm_single_gpu) echo "--quick" ;;
    kernels) echo "--verify" ;;
    *) echo "" ;;
  esac
}
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in ${BENCHES:-bf16_parity decode kernels comm_single_gpu mixed_steps}; do
    echo "== benchmarks/$b.py $(bench_args "$b")"
    # shellcheck disable=SC2046
    timeout ${BENCH_TIMEOUT:-300} python3 "benchmarks/$b.py" $(bench_args "$b") 2>&1 | tee "$OUT/bench_$b.log" | tail -n 30
  done
fi
echo "== summary"
python3 benchmarks/suite_summary.py "$OUT" | tee "$OUT/summary.txt"
