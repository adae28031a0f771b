"""The virtual-rank loops' preload (CPU, no kernels of tpfuse): every op the counting runs for any rank
inside calls_on_streams / replays_on_streams must already have run before the loop, with the same
dtypes and the same pointer alignment (torch's CUDA elementwise kernels pick their vector width from
it, so a different alignment is a different kernel, loaded lazily on first use while peers spin)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.comm.virtual_ranks import add_mismatches, load_counting_kernels


class _KernelKeys(TorchDispatchMode):
    """Records (op, per tensor argument: dtype and data_ptr mod 64) for every op dispatched."""

    def __init__(self):
        super().__init__()
        self.keys: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        self.keys.add((str(func), tuple((t.dtype, t.data_ptr() % 64) for t in tensors)))
        return func(*args, **(kwargs or {}))


def test_the_preload_runs_every_ranks_counting_kernel_with_that_ranks_alignment():
    world_size, expected = 4, [(torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16())]
    outs = [(expected[0][0].clone(), expected[0][1].clone()) for _ in range(world_size)]
    outs[2][1][1, 3] += 1.0  # one wrong element on rank 2
    mismatches = torch.zeros(world_size, dtype=torch.int64)
    with _KernelKeys() as preload:
        load_counting_kernels(mismatches, expected)
    assert mismatches.tolist() == [0] * world_size, "the preload must add nothing"
    with _KernelKeys() as loop:
        for rank in range(world_size):
            add_mismatches(mismatches, rank, outs[rank], expected[0])
    assert mismatches.tolist() == [0, 0, 1, 0]
    assert {key[1][0][1] for key in loop.keys if "add_" in key[0]} == {0, 8, 16, 24}, "one slice per rank"
    assert loop.keys <= preload.keys, f"not preloaded: {sorted(map(str, loop.keys - preload.keys))}"
