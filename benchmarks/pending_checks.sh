#!/usr/bin/env bash
# One device call (about 6 minutes on one H200) for what docs/PERF.md lists under "Not measured yet
# (as of 2026-12-07, 06:30 UTC)": the checks that decide whether a measured-faster option becomes the
# default, and the GPU tests of code that has run only on the CPU. Carry the server wheels (.whl) so
# xgrammar is importable. Usage (device machine, repo root): bash benchmarks/pending_checks.sh
set -u
source benchmarks/device_env.sh
s=$SECONDS
step() { echo "== [$((SECONDS-s)) s] $*"; }
step "the 16-head 3-stage MLA decode tile against float64 (mla_decode_tile switches to it once this passes)"
timeout 120 python3 -m pytest -q -m gpu --timeout=90 tests/kernels/test_mla_gpu.py -k tiles -p no:cacheprovider 2>&1 | tail -n 3
step "grammar mask and logprobs on CUDA-graph steps (needs xgrammar)"
timeout 120 python3 -m pytest -q -m gpu --timeout=90 tests/engine/test_logits_processing.py -p no:cacheprovider 2>&1 | tail -n 3
step "FP8 with 128x128 blocks back on the old GEMV path (4.13 ms with PDL at abf4cf8)"
timeout 90 python3 benchmarks/quant_decode.py --methods fp8-block --iters 20 --prefill-tokens 64 --pdl 2>&1 | grep -E "^ +fp8" | head -n 2
step "the engine's start-up PDL choice for llama-3.1-8b FP8 (the trial's line)"
timeout 150 python3 -m tpfuse generate --model llama-3.1-8b --load-format dummy --quantization fp8 --device cuda \
  --max-tokens 8 --prompt "hello" 2>&1 | grep -i "pdl\|programmatic" | head -n 4
step "done"
