#!/usr/bin/env bash
# Why the one-row INT4 GEMV (kernels/quant_int_half2.py) streams at 43-66 % of copy bandwidth while the
# FP8 GEMV reaches 84 % (docs/PERF.md): Nsight Compute's view of the f16x2 kernel at the llama-3.1-8b
# shapes that lag most (o_proj) and carry most bytes (gate_up). Prints, per profiled launch: duration,
# DRAM throughput, achieved occupancy and its limiter, registers, issue-slot use and the top warp stall
# reasons. Needs ncu (Firecracker machines have it; on gVisor it cannot read counters).
# Usage (device machine, repo root): bash benchmarks/int4_gemv_ncu.sh [SHAPES]   (default o_proj,gate_up)
set -u
source benchmarks/device_env.sh
shapes=${1:-o_proj,gate_up}
if ! command -v ncu > /dev/null; then echo "ncu not found"; exit 1; fi
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard \
  short_scoreboard wait math_pipe_throttle lg_throttle mio_throttle not_selected selected no_instruction \
  dispatch_stall barrier drain)
stalls=${stalls%,}
for shape in ${shapes//,/ }; do
  echo "== f16x2 INT4 GEMV, $shape"
  timeout 240 ncu --clock-control none -k regex:_half2_kernel -c 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --metrics "$stalls" \
    python3 benchmarks/int4_gemv.py --forms half2 --shapes "$shape" 2>&1 \
    | grep -E "_half2_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|stalled|L1/TEX Hit|Mem Busy|Max Bandwidth" \
    | head -n 90
done
