"""Quantized checkpoints sharded over TP=2 (gloo, CPU): each format's scales and codes shard with
their weights (FP8 block scales by 128-blocks, group scales along K for row-parallel, GPTQ zero
points by words, GGUF blocks), so TP=2 logits equal TP=1."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.model import quant_checkpoints as qc
from tests.model.harness import load_for_test, relative_error, run_prefill_then_decode
from tests.model.test_gguf_files import write_qwen3_gguf
from tests.model.test_quantized_checkpoints import FORMATS

PROMPTS = [[5, 250, 17, 3, 99, 42, 7], [1, 2]]
DECODE_TOKENS = [[200, 0], [64, 128]]
CASES = ("fp8-channel", "fp8-block", "int4-group32", "gptq-4bit-group32")


def _logits(source: str, rank: int = 0, world_size: int = 1, comm=None) -> list:
    model, _ = load_for_test(source, tp_rank=rank, tp_size=world_size, comm=comm)
    prefill, decodes = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    return [t.numpy() for t in (prefill, *decodes)]


def _logits_on_rank(rank: int, world_size: int, sources: dict[str, str]) -> dict[str, list]:
    from tpfuse.comm.communicator import TorchDistributedCommunicator

    torch.set_num_threads(1)
    comm = TorchDistributedCommunicator()
    return {name: _logits(source, rank, world_size, comm) for name, source in sources.items()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    found = {}
    for case in CASES:
        kind, quantizer, config, shape = FORMATS[case]
        if case == "fp8-block":  # a row-parallel shard must start on a 128-column block
            shape = {**shape, "intermediate_size": 512}
        directory = tmp_path_factory.mktemp(f"tp-{case}")
        qc.write_quantized(directory, kind, quantizer, config, **shape)
        found[case] = str(directory)
    gguf_path = str(tmp_path_factory.mktemp("tp-gguf") / "tiny-qwen3.gguf")
    write_qwen3_gguf(gguf_path)
    found["gguf-qwen3"] = gguf_path
    return found


@pytest.fixture(scope="module")
def both(sources):
    single = {name: _logits(source) for name, source in sources.items()}
    ranks = run_distributed(_logits_on_rank, 2, sources, timeout=300)
    return single, ranks


@pytest.mark.parametrize("name", [*CASES, "gguf-qwen3"])
def test_tp2_logits_equal_tp1(both, name):
    single, ranks = both
    for got, want in zip(ranks[0][name], single[name], strict=True):
        assert relative_error(torch.from_numpy(got), torch.from_numpy(want)) <= 1e-4
    for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
        assert (a == b).all()


def _half2x_on_rank(rank: int, world_size: int, source: str) -> tuple:
    """Decode logits on one row of an INT4 model in bf16, its Half2X-taking projections forced off then
    on (tests/model/harness.py decode_logits_on_half2x), and how many norms wrote Half2X."""
    from tests.model.harness import decode_logits_on_half2x
    from tpfuse.comm.communicator import TorchDistributedCommunicator
    from tpfuse.kernels.quant_int_half2 import Half2Tile

    class Counting(TorchDistributedCommunicator):
        calls = 0

        def fused_add_rmsnorm_all_reduce_half2x(self, x, residual, weight, eps):
            Counting.calls += 1
            return super().fused_add_rmsnorm_all_reduce_half2x(x, residual, weight, eps)

    torch.set_num_threads(1)
    model, _ = load_for_test(source, dtype="bfloat16", tp_rank=rank, tp_size=world_size, comm=Counting())
    tile = Half2Tile(1, 4, 64, 1, 1)
    plain = decode_logits_on_half2x(model, PROMPTS[0], DECODE_TOKENS[0], tile, on_form=False)
    on_form = decode_logits_on_half2x(model, PROMPTS[0], DECODE_TOKENS[0], tile, on_form=True)
    return plain.numpy(), on_form.numpy(), Counting.calls, len(model.layers)


def test_tp2_half2x_from_the_norms_gives_the_decode_logits_of_the_plain_row(sources):
    """At TP = 2 over torch.distributed the norms write Half2X after their all-reduce and SiLU-and-mul
    on each rank's shard of the intermediate (down is row-parallel), for the INT4 projections that
    take it: the decode logits are those of the plain row, on both ranks alike."""
    ranks = run_distributed(_half2x_on_rank, 2, sources["int4-group32"], timeout=300)
    for plain, on_form, calls, layers in ranks:
        assert calls == 2 * layers * len(DECODE_TOKENS[0])  # every norm but the final one, each step
        plain, on_form = torch.from_numpy(plain), torch.from_numpy(on_form)
        assert relative_error(on_form, plain) < 2e-3
        assert torch.equal(on_form.argmax(-1), plain.argmax(-1))
    assert (ranks[0][1] == ranks[1][1]).all()
