"""Compile the peer-memory kernels to PTX for an sm_90 target and print them as JSON.

Run as `python -m tests.comm.compile_ptx` in a process WITHOUT TRITON_INTERPRET (under the interpreter
@triton.jit gives interpreted functions, which cannot be compiled).
"""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpfuse.comm import allreduce, allreduce_pcie

POINTERS = {
    "x_ptr": "*bf16",
    "residual_ptr": "*bf16",
    "weight_ptr": "*bf16",
    "out_ptr": "*bf16",
    "residual_out_ptr": "*bf16",
    "scale_ptr": "*fp32",
    "peer_table": "*i64",
    "buffer_ptr": "*i32",
    "plan_ptr": "*i32",
}
SCALARS = {"eps": "fp32", "timeout": "i64"}


def _ptx(kernel, epilogue, out_type="*bf16", lockstep=True):
    constexprs = dict(
        WS=4,
        WS_P2=4,
        BLOCK=1024,
        CHUNK_BLOCK=256,
        EPILOGUE=epilogue,
        PHASES=(1 << 62) - 1,
        INTERPRET=False,
        LOCKSTEP=lockstep,
    )
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = POINTERS.get(name) or SCALARS.get(name, "i32")
    signature["out_ptr"] = out_type
    constexprs = {k: v for k, v in constexprs.items() if k in signature}
    # what the launcher's specialisation sees at decode shapes: 16-byte aligned tensors and sizes
    aligned = set(POINTERS) | {"hidden", "chunk", "flag_off", "data_off", "gather_off", "slot_bytes"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def _probe_ptx(write: bool) -> str:
    from tpfuse.comm import link_probe

    signature = {"address": "i64", "out_ptr": "*i64", "iters": "i32", "WRITE": "constexpr"}
    source = ASTSource(fn=link_probe._latency_kernel, signature=signature, constexprs={"WRITE": write})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]


def main() -> None:
    print(
        json.dumps(
            {
                "one_shot": _ptx(allreduce.one_shot_kernel, allreduce.EPILOGUE_NORM.value),
                "two_shot": _ptx(allreduce.two_shot_kernel, allreduce.EPILOGUE_NORM.value),
                "one_shot_fp8": _ptx(
                    allreduce.one_shot_kernel, allreduce.EPILOGUE_NORM_FP8.value, "*fp8e4nv"
                ),
                "two_shot_fp8_rows": _ptx(
                    allreduce.two_shot_kernel, allreduce.EPILOGUE_NORM_FP8_ROWS.value, "*fp8e4nv"
                ),
                "one_shot_fp8_groups": _ptx(
                    allreduce.one_shot_kernel, allreduce.EPILOGUE_NORM_FP8_GROUPS.value, "*fp8e4nv"
                ),
                "two_shot_half2x": _ptx(  # the INT4 GEMV's operands: pairs (int32) and stats
                    allreduce.two_shot_kernel, allreduce.EPILOGUE_NORM_HALF2X.value, "*i32"
                ),
                "staged": _ptx(allreduce_pcie.staged_kernel, allreduce.EPILOGUE_NORM.value),
                "ordered_push": _ptx(
                    allreduce_pcie.staged_kernel, allreduce.EPILOGUE_NORM.value, lockstep=False
                ),
                "hierarchical": _ptx(allreduce_pcie.hierarchical_kernel, allreduce.EPILOGUE_NORM.value),
                "pull": _ptx(allreduce_pcie.pull_kernel, allreduce.EPILOGUE_NORM.value),
                "probe_write_latency": _probe_ptx(True),
                "probe_read_latency": _probe_ptx(False),
            }
        )
    )


if __name__ == "__main__":
    main()
