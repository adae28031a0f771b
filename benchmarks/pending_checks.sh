#!/usr/bin/env bash
# One device call (about 10 minutes, best on one H200: the issues' GPU; two, "a" then "b", where a
# call may run 600 s) for docs/PERF.md's "Not measured yet" list: the GPU tests of code that ran on the
# GPU only inside benchmarks or not at all (FP8 rows from the norms with the model-level test's
# harness fix, W8A8 decode tiles on 128x128 blocks, the f16x2 INT4 GEMV on x made once, the norm and
# SiLU-and-mul writing it, an INT4 model taking it), FP8 prefill per route with start-up's eagerly
# timed choices and FP8 rows off / on, the targets table with PDL (FP8 llama in both forms, DeepSeek-V3
# FP8-block, qwen3-30b-a3b bf16 batch 1-64, the INT4 kernels beside the f16x2 GEMV on x made once, the
# INT4 step with Half2X off / on / chosen, the 3-stage 16-head MLA tile), the fused MoE entry, the
# grouped router, the quantized expert slots under PDL, the engine's start-up PDL choice for FP8
# llama, and last (it ran past 200 s before) the block-FP8 models end to end. $OUT keeps at most 8
# files (what comes back). Carry the server wheels (.whl).
# Usage (device machine, repo root): bash benchmarks/pending_checks.sh [a|b]
# a: the GPU tests, FP8, DeepSeek-V3 and the MoE groups (about 5 minutes); b: INT4, MLA, the PDL choice
# and the block-FP8 models (about 6); no argument: both.
set -u
PART=${1:-all}
in_part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
source benchmarks/device_env.sh
s=$SECONDS
step() { echo "== [$((SECONDS-s)) s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
if in_part a; then
step "GPU tests of code that ran on the GPU only in benchmarks or not at all: FP8 rows, W8A8 decode on 128x128 blocks, the f16x2 GEMV on Half2X"
timeout 200 python3 -m pytest -q -m gpu --timeout=150 tests/kernels/test_gpu_quant_kernels.py tests/comm/test_gpu_virtual_ranks.py \
  -k "fp8_rows or (w8a8_decode and block3) or (half2 and not producers)" -p no:cacheprovider -rf --tb=short > "$OUT/tests_fp8.log" 2>&1
grep -E "^E |FAIL|passed|failed" "$OUT/tests_fp8.log" | tail -n 12
cat "$OUT/tests_fp8.log" >> "$OUT/tests.log" && rm "$OUT/tests_fp8.log"  # $OUT returns at most 8 files
step "an INT4 model taking Half2X from the norms and SiLU-and-mul: the plain row's logits bit for bit; start-up's choice; the engine under CUDA graphs"
timeout 200 python3 -m pytest -q -m gpu --timeout=140 tests/kernels/test_gpu_quant_kernels.py -k "half2x_from_the_producers or int4_engine_taking_half2x" \
  -p no:cacheprovider -rf --tb=short --durations=2 > "$OUT/tests_half2x.log" 2>&1
grep -E "^E |FAIL|passed|failed|[0-9.]+s call" "$OUT/tests_half2x.log" | tail -n 8
cat "$OUT/tests_half2x.log" >> "$OUT/tests.log" && rm "$OUT/tests_half2x.log"
step "rope inside decode attention (its graph cases now restore q), the decode-step kernels, the model"
timeout 150 python3 -m pytest -q -m gpu --timeout=140 tests/kernels/test_rope_decode_attention_gpu.py \
  tests/kernels/test_decode_step_gpu.py tests/model/test_model_gpu.py -p no:cacheprovider 2>&1 | tail -n 2
step "llama-3.1-8b FP8 per-channel and 128x128 blocks beside bf16: batch 1 and 64, prefill per route and with FP8 rows from the norms off / on"
timeout 200 python3 benchmarks/quant_decode.py --methods bf16,fp8-block,fp8 --iters 20 --pdl --json "$OUT/quant_routes.json" \
  > "$OUT/quant_routes.log" 2>&1  # a filter that stops reading early (head) would stop the benchmark
grep -E "^ +(bf16|fp8|fp8-block) +[0-9]|prefill with|Error" "$OUT/quant_routes.log"
step "deepseek-v3-4l FP8 blocks batch 1, per layer"
timeout 140 python3 benchmarks/deepseek_decode.py --batch-sizes 1 --iters 30 --quantization fp8-block 2>&1 \
  | grep -E "MoE router \(256|^ +[0-9]+ +(dense|moe)|^ +1 "
step "qwen3-30b-a3b bf16 batch 1-64 with PDL (issue 22's H200 figure; the fused MoE entry where start-up took it)"
timeout 120 python3 benchmarks/moe_decode.py --batch-sizes 1,8,32,64 --iters 30 --pdl 2>&1 | grep -E "MoE entry|^ +[0-9]+ "
step "the fused MoE entry (norm + router, routed slots; unquantized and quantized) and its start-up choice; the grouped router; quantized MoE under PDL"
timeout 170 python3 -m pytest -q -m gpu --timeout=160 tests/kernels/test_fused_moe_gpu.py tests/model/test_model_gpu.py \
  tests/kernels/test_gpu_quant_kernels.py tests/kernels/test_mla_gpu.py tests/kernels/test_pdl.py \
  -k "entry or routed or grouped_route or quantized_moe_chain" -p no:cacheprovider 2>&1 | tail -n 2
fi
if in_part b; then
step "INT4 one-row kernels: the f16x2 GEMV beside the fp32 forms, on Half2X, with K split; the producers writing Half2X"
timeout 150 python3 benchmarks/int4_gemv.py --forms int,vec,half2,ready 2>&1 | grep -E "best|copy|producer"
step "INT4 llama-3.1-8b model step with PDL (batch 1 and 64; batch 1 with Half2X off / on / chosen; batch 1's kernels)"
timeout 150 python3 benchmarks/quant_decode.py --methods int4 --iters 30 --prefill-tokens 256 --pdl --profile \
  > "$OUT/int4_step.log" 2>&1
grep -E "^ +int4 +[0-9]|batch 1 with|on the input form|kernel|Error" "$OUT/int4_step.log" | head -n 30
step "INT4 experts, qwen3-30b-a3b batch 1 with PDL"
timeout 150 python3 benchmarks/moe_decode.py --batch-sizes 1 --iters 30 --quantization int4 --pdl 2>&1 | tail -n 3
step "MLA decode, 16 heads (the 3-stage tile)"
timeout 100 python3 benchmarks/mla_decode.py --heads 16 --no-old 2>&1 | tail -n 17
step "the engine's start-up PDL choice for llama-3.1-8b FP8 (its INFO log line)"
timeout 150 python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO); from tpfuse.cli import main; \
sys.exit(main(['generate', '--model', 'llama-3.1-8b', '--load-format', 'dummy', '--quantization', 'fp8', \
'--device', 'cuda', '--max-tokens', '8', '--prompt', 'hello']))" 2>&1 | grep -i "programmatic" | head -n 2
step "the block-FP8 models end to end: dummy presets under CUDA graphs, DeepSeek-V3's FP8-block checkpoint"
timeout 230 python3 -m pytest -q -m gpu --timeout=100 tests/kernels/test_gpu_quant_kernels.py \
  tests/model/test_deepseek_v3_quantized_gpu.py -k "(quantized_dummy and fp8-block) or quantized_greedy" \
  -p no:cacheprovider -rf --tb=short --durations=5 > "$OUT/tests_block_models.log" 2>&1
grep -E "^E |FAIL|passed|failed|Timeout|[0-9.]+s call" "$OUT/tests_block_models.log" | tail -n 14
cat "$OUT/tests_block_models.log" >> "$OUT/tests.log" && rm "$OUT/tests_block_models.log"
fi
step "done"
