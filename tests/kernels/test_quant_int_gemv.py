"""The streaming one-row integer GEMV (kernels/quant_int.py StreamTile): under the interpreter against
float64 products of the dequantized weights at odd shapes (rows and K masked, partial last words,
groups that split a 16-byte chunk, bits 4 and 8, offsets, bias, bf16 / fp16 / fp32 x, split-K), its
output and split-K partials poisoned beforehand; and, compiled for sm_90 by the real compiler, its
K loop against the FMA GEMV's default tile.

Run as a script (TRITON_INTERPRET unset) it prints the sm_90 figures per start-up candidate:
python tests/kernels/test_quant_int_gemv.py [--json]
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tpfuse.kernels import quant_int
from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.quant_int import StreamTile
from tpfuse.kernels.skinny_linear import partials_buffer

HIDDEN, GROUP = 4096, 128  # the sm_90 figures: llama-3.1-8b's K, group 128, bf16 x, symmetric


def _case(n, k, bits, group, offsets, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    offs = torch.randn(n, groups, generator=gen) * 0.05 if offsets else None
    packed = quant_int.pack_int(values, bits)
    x = torch.randn(1, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    weight = quant_int.dequantize_int(packed, scales, offs, bits, group, k).double()
    expected = x.double() @ weight.T
    if b is not None:
        expected = expected + b.double()
    return x, packed, scales, offs, b, expected


def _close(out, expected, dtype):
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    assert (out.double() - expected).abs().max().item() <= tol * expected.abs().max().item()


@pytest.mark.parametrize(
    "n,k,bits,group,offsets,dtype,bias,tile",
    [
        (37, 256, 4, 128, False, torch.bfloat16, False, StreamTile(1, 16, 128, 1, 4)),  # rows masked
        (32, 1024, 4, 128, False, torch.bfloat16, True, StreamTile(1, 16, 256, 2, 4, split_k=2)),  # EVEN
        (20, 200, 4, 40, True, torch.bfloat16, True, StreamTile(1, 8, 64, 2, 4, split_k=2)),  # word chunks
        (24, 100, 4, 100, False, torch.bfloat16, False, StreamTile(1, 8, 64, 1, 4)),  # last word half used
        (19, 196, 4, 56, True, torch.float16, True, StreamTile(1, 8, 64, 2, 4)),  # half word, fp16 x
        (12, 200, 8, 20, False, torch.float32, False, StreamTile(1, 4, 64, 1, 4, split_k=3)),  # 8-bit, fp32
        (40, 512, 8, 128, True, torch.bfloat16, False, StreamTile(1, 16, 256, 2, 4, split_k=2)),
        (64, 1024, 4, 32, False, torch.bfloat16, True, StreamTile(1, 32, 256, 1, 4, split_k=4)),
        (16, 512, 4, 256, False, torch.bfloat16, False, StreamTile(1, 8, 128, 1, 4)),  # group spans steps
        (21, 300, 8, 300, True, torch.bfloat16, True, StreamTile(1, 8, 128, 1, 4, split_k=2)),  # one group
    ],
)
def test_stream_gemv_matches_float64_and_writes_every_output(n, k, bits, group, offsets, dtype, bias, tile):
    x, packed, scales, offs, b, expected = _case(n, k, bits, group, offsets, dtype, bias, n * 31 + k)
    partials_buffer(x.device, 4 * n).fill_(float("nan"))  # each split must store before the sum reads it
    out = torch.full((1, n), float("nan"), dtype=dtype)
    assert quant_int.stream_gemv(x, packed, scales, offs, bits, group, b, tile, out=out) is out
    _close(out, expected, dtype)
    assert not arrival_counters(x.device, 1).any()
    again = quant_int.int_linear_triton(x, packed, scales, offs, bits, group, b, tile=tile)
    assert torch.equal(again, out)  # split-K sums in split order: no dependence on arrival order


def test_stream_gemv_reads_unaligned_bf16_x_value_by_value():
    _, packed, scales, offs, b, _ = _case(24, 256, 4, 64, True, torch.bfloat16, True, 5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(1, 260, generator=gen).bfloat16()
    x = rows[:, 2:258]  # 4-byte aligned at best: no int64 quads
    assert not quant_int.x_quads(x)
    weight = quant_int.dequantize_int(packed, scales, offs, 4, 64, 256).double()
    expected = x.double() @ weight.T + b.double()
    _close(quant_int.int_linear_triton(x, packed, scales, offs, 4, 64, b, tile=StreamTile(1, 8, 128, 2, 4)),
           expected, torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize("magnitude", [2.0**-28, 2.0**40])
def test_stream_gemv_is_exact_to_rounding_across_the_x_range_it_documents(magnitude):
    """|x| below 2^(128 - STREAM_EXP) stays finite, and products above 2^(23 - STREAM_EXP) are normal."""
    x, packed, scales, _, _, _ = _case(16, 256, 4, 128, False, torch.float32, False, 7)
    x = x * magnitude
    weight = quant_int.dequantize_int(packed, scales, None, 4, 128, 256).double()
    out = quant_int.int_linear_triton(x, packed, scales, None, 4, 128, tile=StreamTile(1, 16, 256, 1, 4))
    _close(out, x.double() @ weight.T, torch.float32)


def test_stream_tile_takes_one_row_only():
    x, packed, scales, *_ = _case(8, 64, 4, 32, False, torch.float32, False, 8)
    with pytest.raises(ValueError, match="the GEMV tile takes one row"):
        quant_int.int_linear_triton(x.expand(2, -1), packed, scales, None, 4, 32, tile=StreamTile(1, 8, 64))


# --- sm_90 figures (the real compiler on the CPU; tests/kernels/quant_int_asm.py's conventions) ---


def _candidates():
    from tpfuse.model.linear_choice import QUANT_TILES

    return [t for t in QUANT_TILES[1] if isinstance(t, StreamTile)]


def compile_stream(tile, bits=4, group=GROUP, hidden=HIDDEN, offsets=False, even=True):
    """The compiled _int_stream_kernel at the JIT's specialization (bf16 x read as quads, on CUDA)."""
    import quant_int_asm
    import triton

    per_word = 32 // bits
    chunk_words = quant_int.stream_chunk_words(bits, group, hidden)
    block_k = max(chunk_words * per_word, min(tile.block_k, triton.next_power_of_2(hidden)))
    constexprs = dict(STRIDE_QN=-(-hidden // per_word), STRIDE_SN=-(-hidden // group), BITS=bits, GROUP=group,
                      HAS_OFFSET=offsets, HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                      CW=chunk_words, SPLIT_K=tile.split_k, REG_AHEAD=tile.num_stages > 1,
                      L2_AHEAD=tile.l2_ahead, EVEN=even, WHOLE_CHUNKS=hidden % (chunk_words * per_word) == 0,
                      X_QUADS=True)  # fmt: skip
    pointers = {"*": "*bf16", "q_ptr": "*i32", "o_ptr": "*fp32", "partials_ptr": "*fp32",
                "counter_ptr": "*i32"}  # fmt: skip
    ints = {"num_cols": "i32", "k_per_split": "i32"}
    return quant_int_asm._compile(quant_int._int_stream_kernel, pointers, ints, constexprs, tile), block_k


def stream_stats(tile, **variant) -> dict:
    """Registers, stack, shared memory and the K loop's instructions per weight (the loop: the largest
    backward branch; weights: those a thread takes per iteration)."""
    import quant_int_asm

    compiled, block_k = compile_stream(tile, **variant)
    usage, sass = quant_int_asm._disassemble(compiled.asm["cubin"])
    loop = quant_int_asm.k_loop(sass)
    weights = tile.block_n * block_k / (32 * tile.num_warps)
    code_loads = [i for i, (_, op, rest) in enumerate(loop) if op == "LDG" and ".EF.128" in rest]
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {
        "kernel": "stream", "tile": tile.label(), "variant": variant, "loop_instructions": len(loop),
        "weights_per_thread": weights, "per_weight": round(len(loop) / weights, 2),
        "registers": int(regs.group(1)), "stack": int(regs.group(2)), "shared": compiled.metadata.shared,
        "spill_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)), "code_loads": len(code_loads),
        "last_code_load": code_loads[-1] / len(loop) if code_loads else None,
        "prefetches": sum(op == "CCTL" for _, op, _ in loop),
        "barriers": sum(op == "BAR" for _, op, _ in loop),
        "mix": dict(Counter(op for _, op, _ in loop).most_common(10)),
    }  # fmt: skip


def asm_rows(everything: bool) -> list[dict]:
    """The FMA GEMV's first candidate (everything: and the kernel's default tile), then every StreamTile
    candidate, then variants of the first two: offsets with group 32, masked rows and K, K ending
    inside a chunk, 8-bit."""
    import quant_int_asm

    from tpfuse.kernels.quant_dot import default_tile
    from tpfuse.model.linear_choice import QUANT_TILES

    rows = [dict(quant_int_asm.stats("gemv", QUANT_TILES[1][0]), variant={})]
    if everything and QUANT_TILES[1][0] != default_tile(1):
        rows.append(dict(quant_int_asm.stats("gemv", default_tile(1)), variant={}))
    candidates = _candidates()
    rows += [stream_stats(tile) for tile in candidates]
    rows.append(stream_stats(candidates[0], group=32, offsets=True))  # GPTQ-like: offsets, group 32
    rows.append(stream_stats(candidates[0], even=False))  # masked rows and K
    rows.append(stream_stats(candidates[0], even=False, hidden=HIDDEN + 4))  # a chunk cut short: words masked
    rows.append(stream_stats(candidates[1], bits=8))
    return rows


def test_stream_candidates_compile_for_sm90_without_spills_and_below_the_default_gemv():
    """Every StreamTile start-up timing tries: no local memory, L2 prefetches and (K a multiple of a
    chunk) 16-byte code loads in the K loop, fewer instructions per weight than the FMA GEMV's
    default tile and than an SM can issue against 4.3 TB/s of INT4 (128 / 33); with the next step in
    registers, its loads in the first quarter of the loop (a barrier keeps ptxas from sinking them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, __file__, "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    gemv = rows[0]
    stream = [r for r in rows if r["kernel"] == "stream"]
    assert len(stream) == len(_candidates()) + 4
    for row in stream:
        assert row["stack"] == 0 and row["spill_ops"] == 0 and row["prefetches"] > 0, row
        assert row["code_loads"] > 0 or row["variant"].get("hidden", HIDDEN) % 32, row
    for row in (r for r in stream if not r["variant"]):
        assert row["per_weight"] < min(gemv["per_weight"], 128 / 33), (row, gemv)
        if " s2 " in row["tile"]:
            assert row["barriers"] > 0 and row["last_code_load"] < 0.25, row


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels for real")
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rows = asm_rows(everything="--json" not in sys.argv)
    if "--json" in sys.argv:
        print(json.dumps(rows))
        return 0
    print(f"sm_90, K = {HIDDEN}, group {GROUP}, bf16 x (else as noted); 4.3 TB/s of INT4 allows 3.9 a weight")
    for r in rows:
        variant = ",".join(f"{k}={v}" for k, v in r["variant"].items()) or "-"
        print(f"{r['tile']:34} {variant:22} loop {r['loop_instructions']:5} / {r['weights_per_thread']:4.0f} "
              f"= {r['per_weight']:5.2f} per weight, {r['registers']:3} registers, stack {r['stack']}, "
              f"shared {r['shared']}, spills {r.get('spill_ops', '-')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
