#!/usr/bin/env bash
# The multi-GPU issues in few device calls: doctor, the multigpu tests and comm-bench at every TP the
# machine has (issue 8: `comm`), then TP decode and the seeds' experiment (issue 9: `experiment`).
# Usage (device machine, repo root, carry .whl): bash benchmarks/multigpu_suite.sh [comm|experiment|all]
# Logs and JSON land in $OUT; each step has its own time limit (env COMM_TIMEOUT, EXPERIMENT_TIMEOUT).
set -u
what=${1:-all}
source benchmarks/device_env.sh  # multicast off, wheels, PYTHONPATH, $OUT
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus" | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
if [ "$what" = comm ] || [ "$what" = all ]; then
  python3 -m tpfuse doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
  python3 -m tpfuse doctor | tail -n 25
  timeout "${COMM_TIMEOUT:-600}" python3 -m pytest -q -m multigpu -p no:cacheprovider -rf \
    tests/comm/test_multigpu.py tests/engine/test_gpu_tensor_parallel.py 2>&1 | tee "$OUT/multigpu_tests.log" | tail -n 15
  for tp in 2 4 8; do
    if [ "$tp" -le "$gpus" ]; then
      timeout 300 python3 -m tpfuse comm-bench --nproc "$tp" 2>&1 | tee "$OUT/comm_bench_tp$tp.log" | tail -n 40
    fi
  done
fi
if [ "$what" = experiment ] || [ "$what" = all ]; then
  timeout "${EXPERIMENT_TIMEOUT:-1500}" python3 benchmarks/tp_decode.py --models llama-3.1-8b,llama-3.1-70b \
    2>&1 | tee "$OUT/tp_decode.log" | tail -n 25
  timeout "${EXPERIMENT_TIMEOUT:-1500}" python3 benchmarks/tp_spec_experiment.py --model llama-3.1-70b --tp-size "$gpus" \
    2>&1 | tee "$OUT/tp_spec.log" | tail -n 30
  (cd "$OUT" && tar czf tp_spec.tgz tp_spec && rm -rf tp_spec)
fi
