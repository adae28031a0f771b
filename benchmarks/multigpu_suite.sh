#!/usr/bin/env bash
# The multi-GPU issues in device calls of at most 10 minutes each:
#   comm                 doctor, the multigpu tests and comm-bench at every TP the machine has (issue 8)
#   tp_decode            TP decode at every TP, fused vs NCCL, 8B and 70B (issue 4's benchmark)
#   experiment [CONFIGS] the seeds' experiment at the largest TP (issue 9); CONFIGS (comma-separated,
#                        default all five) lets one call run a part: e.g. `nccl,fused`, then
#                        `eagle3-nccl,eagle3-fused`, then `adaptive`; each part leaves its own
#                        $OUT/tp_spec_<configs>.tgz, compared afterwards with `tpfuse bench compare`
# Usage (device machine, repo root, carry .whl): bash benchmarks/multigpu_suite.sh comm|tp_decode|experiment
# Logs and JSON land in $OUT; every step has a time limit below the device tool's 600 s per call
# (env STEP_TIMEOUT overrides).
set -u
what=${1:-comm}
configs=${2:-nccl,fused,eagle3-nccl,eagle3-fused,adaptive}
limit=${STEP_TIMEOUT:-540}
source benchmarks/device_env.sh  # multicast off, wheels, PYTHONPATH, $OUT
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus" | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
if [ "$what" = comm ]; then
  python3 -m tpfuse doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor.err"
  python3 -m tpfuse doctor | tail -n 25
  timeout 240 python3 -m pytest -q -m multigpu -p no:cacheprovider -rf \
    tests/comm/test_multigpu.py tests/engine/test_gpu_tensor_parallel.py 2>&1 | tee "$OUT/multigpu_tests.log" | tail -n 15
  for tp in 2 4 8; do
    if [ "$tp" -le "$gpus" ]; then
      timeout 120 python3 -m tpfuse comm-bench --nproc "$tp" --json > "$OUT/comm_tp$tp.json" 2> "$OUT/comm_bench_tp$tp.err" \
        && python3 -c "import json, sys; from tpfuse.comm.bench import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
          "$OUT/comm_tp$tp.json" | tee "$OUT/comm_bench_tp$tp.log" | tail -n 40
    fi
  done
fi
if [ "$what" = tp_decode ]; then
  timeout "$limit" python3 benchmarks/tp_decode.py --models llama-3.1-8b,llama-3.1-70b \
    2>&1 | tee "$OUT/tp_decode.log" | tail -n 25
fi
if [ "$what" = experiment ]; then
  tag=${configs//,/_}
  timeout "$limit" python3 benchmarks/tp_spec_experiment.py --model llama-3.1-70b --tp-size "$gpus" \
    --configs "$configs" 2>&1 | tee "$OUT/tp_spec_$tag.log" | tail -n 30
  (cd "$OUT" && tar czf "tp_spec_$tag.tgz" tp_spec && rm -rf tp_spec)
fi
python3 benchmarks/suite_summary.py "$OUT" | tee "$OUT/summary.txt"
