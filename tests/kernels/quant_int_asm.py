"""Instructions per weight in the steady-state K loop of the one-row INT4 kernels for sm_90, without a
GPU: the FMA GEMV of kernels/quant_int.py, the tensor-core kernel of kernels/quant_int_magic.py, the
f16x2 GEMV of kernels/quant_int_half2.py ("half2" rows) and the GemvTile forms of
kernels/quant_int_gemv.py ("vec" / "xs" rows), at the tiles start-up timing tries
(model/linear_choice.py QUANT_TILES[1]; --sweep: also benchmarks/int4_gemv.py's GEMV_SWEEP), K = 4096,
group 128, bf16 x, symmetric codes.

The real compiler builds each cubin with its arguments specialized as the JIT does at run time
(every pointer and integer divisible by 16, except the magic kernel's nibble mask 0x000F000F), and
cuobjdump (shipped with Triton) disassembles it. The K loop is the largest backward branch in the
SASS. Its instructions over the weights a thread handles per iteration (BLOCK_N * BLOCK_K / threads)
are the instructions per weight. An SM issues 128 per clock; 4.3 TB/s of INT4 weights over 132 SMs
at 1.98 GHz is about 33 weights per clock per SM, so a loop above 128 / 33 = 3.9 per weight cannot
reach the copy bandwidth.
A GemvTile form at K = 4096 may have no K loop (one step): its per_weight counts the whole program as
it runs at gate_up (N = 28672; the "xs" loop's iterations as launched on 132 SMs), reduction and
set-up included, and code_loads gives the positions of its codes' loads among the instructions of
the step (the loop body, or the program): ptxas sinks loads towards their first use unless the
tile pins them (GemvTile.pin).
--ready prints, for the f16x2 start-up tiles, the program with x converted per program and on x made
once beforehand (quant_int_half2.Half2X): instructions, registers, where the codes' loads sit.
Usage: python tests/kernels/quant_int_asm.py [--json] [--sweep] [--ready], with TRITON_INTERPRET unset.
The counts are the installed Triton's; the device machine's may differ (3.6 kept 168 registers where
3.8 kept 80, docs/PERF.md): install that version beside it (`pip install --target /tmp/triton36
--no-deps triton==3.6.0`) and put it first on PYTHONPATH to see the device's code.
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

from tpfuse.kernels import quant_int, quant_int_gemv, quant_int_half2, quant_int_magic
from tpfuse.model.linear_choice import QUANT_TILES

sys.path.insert(0, os.path.dirname(__file__))
from compile_for_gpu import _signature  # noqa: E402

HIDDEN, GROUP = 4096, 128
NUM_COLS, SMS = 28672, 132  # gate_up on an H200: the "xs" form's iterations per program
ISSUE_LIMIT = 128 / 33  # instructions per weight an SM can issue at 4.3 TB/s of INT4 weights
_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", re.M)


def _compile(kernel, pointers: dict, ints: dict, constexprs: dict, tile):
    signature = _signature(kernel, pointers, ints, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and name != "nibbles"}  # fmt: skip
    return triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
    )


def compile_gemv(tile):
    """quant_int's FMA GEMV, bf16 x read as pairs, symmetric, EVEN."""
    block_k = quant_int.gemv_block_k(tile.block_k, HIDDEN, 4)
    constexprs = dict(BITS=4, GROUP=GROUP, HAS_OFFSET=False, HAS_BIAS=False, BLOCK_N=tile.block_n,
                      BLOCK_K=block_k, EVEN=True, X_PAIRS=True)  # fmt: skip
    return _compile(quant_int._int_gemv_kernel, {"*": "*bf16", "q_ptr": "*i32"}, {"num_cols": "i32"},
                    constexprs, tile), block_k  # fmt: skip


def compile_magic(tile):
    """quant_int_magic's tensor-core kernel, bf16 x, symmetric, EVEN."""
    block_k = quant_int_magic.magic_block_k(tile.block_k, HIDDEN, GROUP)
    constexprs = dict(GROUP=GROUP, HAS_OFFSET=False, HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                      SUM_STEPS=quant_int_magic.SUM_STEPS, SPLIT_K=tile.split_k,
                      PREFETCH=tile.num_stages == 1, EVEN=True)  # fmt: skip
    ints = {"num_cols": "i32", "k_per_split": "i32", "nibbles": "i32"}
    pointers = {"*": "*bf16", "q_ptr": "*i32", "partials_ptr": "*fp32", "counter_ptr": "*i32"}
    return _compile(quant_int_magic._magic_kernel, pointers, ints, constexprs,
                    tile), block_k  # fmt: skip


_HALF2_POINTERS = {"*": "*bf16", "q_ptr": "*i32", "pairs_ptr": "*i32", "inv_m_ptr": "*fp32",
                   "sums_ptr": "*fp32", "partials_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip


def _half2_constexprs(tile, ready: bool) -> dict:
    block_k = quant_int_half2.half2_step(tile, HIDDEN)
    split_k, k_per_split = quant_int_half2.half2_split(tile, HIDDEN)
    return dict(hidden=HIDDEN, stride_qn=HIDDEN // 8, stride_sn=HIDDEN // GROUP, GROUP=GROUP,
                HAS_OFFSET=False, HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_N=True,
                K_MASK=HIDDEN % block_k != 0, X_FP16=False, X_READY=ready, INTERPRET=False, SPLIT_K=split_k,
                K_PER_SPLIT=k_per_split)


def compile_half2(tile):
    """quant_int_half2's f16x2 GEMV, bf16 x, symmetric, N a multiple of the rows per program."""
    block_k = quant_int_half2.half2_step(tile, HIDDEN)
    return _compile(quant_int_half2._half2_kernel, _HALF2_POINTERS,
                    {"num_cols": "i32"}, _half2_constexprs(tile, False), tile), block_k  # fmt: skip


def compile_form(tile):
    """kernels/quant_int_gemv.py's kernel for a GemvTile, bf16 x as pairs, symmetric, N a multiple of
    the rows per program; K, the strides and the masks specialized as its launcher does."""
    block_k = quant_int_gemv.gemv_step(tile, HIDDEN, 4)
    form = "xs" if tile.form == "xs" and block_k >= HIDDEN else "vec"
    kernel = quant_int_gemv._xs_kernel if form == "xs" else quant_int_gemv._vec_kernel
    constexprs = dict(hidden=HIDDEN, stride_qn=HIDDEN // 8, stride_sn=HIDDEN // GROUP, BITS=4, GROUP=GROUP,
                      HAS_OFFSET=False, HAS_BIAS=False, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                      PREFETCH=tile.prefetch, EVEN_N=True, K_MASK=quant_int_gemv.k_mask(HIDDEN, block_k, 4),
                      X_PAIRS=True, PIN=tile.pin)  # fmt: skip
    ints = {"num_cols": "i32", "m_lo": "i32", "m_hi": "i32", "zero": "i32"}
    signature = _signature(kernel, {"*": "*bf16", "q_ptr": "*i32"}, ints, constexprs)
    # as the JIT specializes them: every argument divisible by 16 but zero (do_not_specialize)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name] != "constexpr" and name != "zero"}  # fmt: skip
    options = {"num_warps": tile.num_warps, "num_stages": 1}
    if tile.max_registers:
        options["maxnreg"] = tile.max_registers
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)  # fmt: skip
    return compiled, block_k, form


def half2_program_stats(tile, ready: bool) -> dict:
    """The f16x2 kernel's SASS for a Half2Tile (static instructions: one K step at K = 4096 for the
    4096-step tiles, a loop of two for the 2048-step one), on x converted per program or made once
    (Half2X, ready): instructions, registers, and where the codes' loads sit among them."""
    kernel, pointers = quant_int_half2._half2_kernel, _HALF2_POINTERS
    constexprs = _half2_constexprs(tile, ready)
    usage, sass = _disassemble(_compile(kernel, pointers, {"num_cols": "i32"}, constexprs, tile).asm["cubin"])
    code = [op + rest for _, _, op, rest in _LINE.findall(sass)]
    loads = [i for i, line in enumerate(code) if line.startswith("LDG") and ".EF" in line]
    return {
        "tile": tile.label() + " on Half2X" * ready, "instructions": len(code),
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "code_loads": f"{loads[0]}-{loads[-1]}" if loads else "",
    }  # fmt: skip


def form_stats(tile) -> dict:
    """A GemvTile's row: see the module doc."""
    compiled, block_k, form = compile_form(tile)
    usage, sass = _disassemble(compiled.asm["cubin"])
    code = [(int(a, 16), op, rest) for a, _, op, rest in _LINE.findall(sass)]
    loop = k_loop(sass)
    threads = 32 * tile.num_warps
    if form == "xs":
        groups = -(-NUM_COLS // tile.block_n)
        programs = -(-groups // -(-groups // (tile.programs_per_sm * SMS)))
        iterations = -(-groups // programs)
        weights = tile.block_n * HIDDEN * iterations / threads
    else:
        iterations = -(-HIDDEN // block_k)
        weights = tile.block_n * HIDDEN / threads
    executed = len(code) - len(loop) + len(loop) * iterations if loop else len(code)
    body = loop if loop else code
    loads = [i for i, (_, op, rest) in enumerate(body) if op == "LDG" and ".EF" in rest]  # the codes
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ops = Counter(op for _, op, _ in body)
    return {
        "kernel": form, "tile": tile.label(), "block_k": block_k, "loop_instructions": len(loop),
        "program_instructions": len(code), "weights_per_thread": weights,
        "per_weight": round(executed / weights, 2), "registers": int(regs.group(1)),
        "stack": int(regs.group(2)), "shared": compiled.metadata.shared,
        "code_loads": f"{loads[0]}-{loads[-1]} of {len(body)}" if loads else "",
        "mix": dict(ops.most_common(12)),
    }  # fmt: skip


def _disassemble(cubin: bytes) -> tuple[str, str]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return usage, sass


def k_loop(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of the instructions of the largest backward branch's loop."""
    code = [(int(a, 16), op, rest) for a, _, op, rest in _LINE.findall(sass)]
    best: list = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [c for c in code if int(target.group(1), 16) <= c[0] <= address]
            best = body if len(body) > len(best) else best
    return best


def stats(name: str, tile) -> dict:
    compiled, block_k = {"magic": compile_magic, "half2": compile_half2, "gemv": compile_gemv}[name](tile)
    usage, sass = _disassemble(compiled.asm["cubin"])
    loop = k_loop(sass)
    weights = tile.block_n * block_k / (32 * tile.num_warps)  # per thread per iteration
    ops = Counter(op for _, op, _ in loop)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {
        "kernel": name, "tile": tile.label(), "block_k": block_k, "loop_instructions": len(loop),
        "weights_per_thread": weights, "per_weight": round(len(loop) / weights, 2),
        "registers": int(regs.group(1)), "stack": int(regs.group(2)), "shared": compiled.metadata.shared,
        "mix": dict(ops.most_common(12)),
    }  # fmt: skip


def rows(tiles=None) -> list[dict]:
    out = []
    for tile in QUANT_TILES[1] if tiles is None else tiles:
        if isinstance(tile, quant_int_gemv.GemvTile):
            out.append(form_stats(tile))
        elif isinstance(tile, quant_int_half2.Half2Tile):
            out.append(stats("half2", tile))
        else:
            out.append(stats("magic" if isinstance(tile, quant_int_magic.MagicTile) else "gemv", tile))
    return out


def sweep_tiles() -> tuple:
    """QUANT_TILES[1] and benchmarks/int4_gemv.py's GEMV_SWEEP."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "int4_gemv.py")
    spec = importlib.util.spec_from_file_location("int4_gemv", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return QUANT_TILES[1] + tuple(t for t in bench.GEMV_SWEEP if t not in QUANT_TILES[1])


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels for real")
        return 2
    if "--ready" in sys.argv:  # the f16x2 start-up tiles on x converted per program and made once
        for tile in (t for t in QUANT_TILES[1] if isinstance(t, quant_int_half2.Half2Tile)):
            for ready in (False, True):
                r = half2_program_stats(tile, ready)
                print(f"{r['tile']:32} {r['instructions']:5} instructions, {r['registers']:3} registers, "
                      f"code loads at {r['code_loads']}")  # fmt: skip
        return 0
    table = rows(sweep_tiles() if "--sweep" in sys.argv else None)
    if "--json" in sys.argv:
        print(json.dumps(table))
        return 0
    print(f"K = {HIDDEN}, group {GROUP}, bf16 x; 4.3 TB/s needs at most {ISSUE_LIMIT:.1f} per weight")
    for r in table:
        if r["kernel"] in ("vec", "xs"):
            print(
                f"{r['kernel']:6} {r['tile']:38} program {r['program_instructions']:4}, loop "
                f"{r['loop_instructions']:4}: {r['per_weight']:5.2f} per weight over the program, "
                f"{r['registers']} registers, stack {r['stack']}, shared {r['shared']}, code loads at "
                f"{r['code_loads']}  {r['mix']}"
            )
            continue
        print(
            f"{r['kernel']:6} {r['tile']:38} loop {r['loop_instructions']:4} / "
            f"{r['weights_per_thread']:4.0f} weights = {r['per_weight']:5.2f} per weight, "
            f"{r['registers']} registers, stack {r['stack']}, shared {r['shared']}  {r['mix']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
