"""What the real compiler makes of kernels/quant_dot.py for sm_90, without a GPU: per (INT4 | FP8, tile)
the shared memory, the cp.async copies by size, shared-memory and local-memory (spill) accesses and
MMA instructions in the PTX, and (where Triton ships cuobjdump) registers, stack and the SASS mix.

Arguments are specialized as the JIT does at run time for the engine's shapes (every pointer and
integer divisible by 16), so the loads vectorize as they do on the GPU.
With --w8a8, the FP8 W8A8 decode tiles instead (kernels/quant_fp8_w8a8.py): the e4m3 MMA they run,
the weight conversions they must not have, and the K loop's SASS instructions per weight.
Usage: python tests/kernels/quant_dot_asm.py [--w8a8] [--json], with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpfuse.kernels import quant_dot, quant_fp8_w8a8
from tpfuse.kernels.quant_dot import IntTile
from tpfuse.model.linear_choice import QUANT_TILES

sys.path.insert(0, os.path.dirname(__file__))
from compile_for_gpu import _signature  # noqa: E402

# the 64-row candidates start-up times and the prefill default, at llama-3.1-8b's K = 4096, group 128
TILES = (*QUANT_TILES[64], quant_dot.default_tile(2048))
PTX_COUNTS = {
    "cp.async 4 B": r"cp\.async\.c[ga][^;]*, 0x4[,;]",
    "cp.async 8 B": r"cp\.async\.c[ga][^;]*, 0x8[,;]",
    "cp.async 16 B": r"cp\.async\.c[ga][^;]*, 0x10[,;]",
    "st.shared": r"\bst\.shared",
    "ld.shared": r"\bld\.shared",
    "local": r"\b(?:ld|st)\.local",
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
}
SASS_OPS = ("LDGSTS", "LDS", "STS", "LDL", "STL", "HGMMA", "QGMMA", "LOP3", "PRMT", "F2FP", "F2F", "FFMA")
# e4m3 weights converted for the MMA (the W8A16 path): the conversion pipe's instructions
WEIGHT_CONVERSIONS = r"F2FP\.F16\.E4M3\.UNPACK|F2F\.BF16\.F16"


def compile_dot(bits: int, tile: IntTile, scale_k: int = 128, hidden: int = 4096, x_fp8: int = 0):
    """The compiled _quant_dot_kernel (bf16 x, or e4m3 x for X_QUANTIZED; symmetric codes or e4m3) at
    the JIT's specialization."""
    block_k, mode = quant_dot.scale_plan(tile.block_k, scale_k, hidden, False)
    constexprs = dict(BITS=bits, SCALE_N=1, SCALE_K=scale_k, SCALE_MODE=mode, HAS_OFFSET=False,
                      HAS_BIAS=False, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                      SWAP=tile.swap, SPLIT_K=tile.split_k, EVEN_K=hidden % block_k == 0,
                      DOT_PRECISION="tf32", X_FP8=x_fp8)  # fmt: skip
    pointers = {"*": "*bf16", "w_ptr": "*fp8e4nv" if bits == 0 else "*i32",
                "s_ptr": "*fp32" if bits == 0 else "*bf16", "o_ptr": "*fp32", "partials_ptr": "*fp32",
                "counter_ptr": "*i32", "xs_ptr": "*fp32"}  # fmt: skip
    if x_fp8 == quant_dot.X_QUANTIZED:
        pointers["x_ptr"] = "*fp8e4nv"
    kernel = quant_dot._quant_dot_kernel
    ints = {"num_rows": "i32", "num_cols": "i32", "k_per_split": "i32"}
    signature = _signature(kernel, pointers, ints, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr"}  # fmt: skip
    return triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
    )


def _loop_instructions(sass: str) -> int:
    """SASS instructions in the longest backward branch's body (the K loop)."""
    line = r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);"
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(line, sass, re.M)]
    loops = []
    for at, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    if not loops:
        return 0
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return sum(start <= at <= end for at, _, _ in code)


def _sass_stats(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    stats = {}
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if m:
        stats.update(registers=int(m.group(1)), stack=int(m.group(2)))
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    stats.update({op: ops[op] for op in SASS_OPS}, sass_instructions=sum(ops.values()))
    stats.update(weight_conversions=len(re.findall(WEIGHT_CONVERSIONS, sass)), loop=_loop_instructions(sass))
    return stats


def stats(bits: int, tile: IntTile) -> dict:
    compiled = compile_dot(bits, tile)
    ptx = compiled.asm["ptx"]
    row = {"weights": "int4" if bits else "fp8", "tile": tile.label(), "shared": compiled.metadata.shared}
    row.update({name: len(re.findall(pattern, ptx)) for name, pattern in PTX_COUNTS.items()})
    row.update(_sass_stats(compiled.asm["cubin"]))
    return row


def w8a8_stats(tile: quant_fp8_w8a8.W8A8Tile, scale_k: int) -> dict:
    """A W8A8 decode tile at per-channel (scale_k 4096) or 128-column block scales; per_weight: the K
    loop's SASS instructions over the weights a thread takes per K step."""
    x_fp8 = quant_dot.X_QUANTIZED if tile.prequantize else quant_dot.X_QUANTIZE_HERE
    compiled = compile_dot(0, tile, scale_k=scale_k, x_fp8=x_fp8)
    row = {"tile": tile.label(), "scales": "channel" if scale_k == 4096 else "block 128"}
    row.update(_sass_stats(compiled.asm["cubin"]))
    if "loop" in row:
        weights = tile.block_n * tile.block_k / (tile.num_warps * 32)
        row["per_weight"] = round(row["loop"] / weights, 2)
    return row


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels for real")
        return 2
    if "--w8a8" in sys.argv:
        tiles = dict.fromkeys(t for ts in quant_fp8_w8a8.W8A8_TILES.values() for t in ts)
        rows = [w8a8_stats(tile, scale_k) for tile in tiles for scale_k in (4096, 128)]
    else:
        rows = [stats(bits, tile) for tile in TILES for bits in (4, 0)]
    if "--json" in sys.argv:
        print(json.dumps(rows))
        return 0
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row.get(k, "")) for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
