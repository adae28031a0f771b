"""A mixed step's attention: its leading one-token rows by the decode kernel, its prompt chunks by
the prefill kernel, giving what the prefill kernel gives for every row (float64 reference)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse import knobs
from tpfuse.kernels.prefill_attention import prefill_attention_ref
from tpfuse.model import attention
from tpfuse.model.attention import AttentionMetadata, mixed_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 4


# bf16 on the Triton kernels only on a GPU: the interpreter multiplies bf16 tl.dot operands as raw bits
@pytest.mark.parametrize(
    ("kernels", "dtype"), [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)]
)
def test_decode_rows_then_chunks_equal_the_float64_prefill_of_every_row(kernels, dtype, monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", kernels)
    knobs.reload()
    gen = torch.Generator().manual_seed(7)
    context_lens, query_lens = [5, 17, 1, 33, 9], [1, 1, 1, 6, 9]  # three decodes, then two chunks
    k_cache, v_cache, tables, seq_lens = random_paged_kv(context_lens, BLOCK, KV_HEADS, HEAD_DIM, dtype, gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), HEADS, HEAD_DIM, generator=gen).to(dtype)
    attn = AttentionMetadata(
        slot_mapping=torch.full((int(starts[-1]),), -1), block_tables=tables, seq_lens=seq_lens,
        query_start_loc=starts, max_query_len=max(query_lens), max_seq_len=max(context_lens),
        is_decode=False, num_decode_rows=3,
    )  # fmt: skip
    calls = []
    decode = _counting(attention.decode_attention_op, calls, "decode")
    monkeypatch.setattr(attention, "decode_attention_op", decode)
    scale = HEAD_DIM**-0.5
    got = mixed_attention(q, (k_cache, v_cache), attn, scale)
    caches = k_cache.double(), v_cache.double()
    want = prefill_attention_ref(q.double(), *caches, tables, seq_lens, starts, max(query_lens), scale)
    # one compiled variant, whatever the rows; written into the result's rows, no concatenation
    assert [(name, rows, kw["split"]) for name, rows, kw in calls] == [("decode", 3, False)]
    assert got.shape == q.shape
    assert_close_to_float64(got, want, dtype)


def _counting(op, calls, name):
    def counted(q, *args, **kwargs):
        calls.append((name, q.shape[0], kwargs))
        return op(q, *args, **kwargs)

    return counted


def test_a_mixed_steps_decode_rows_launch_a_variant_compiled_at_start_up(monkeypatch):
    """The decode kernel's compile key in a mixed step (unsplit, a 16-byte aligned table of any width)
    is one that decode_attention.compile_unsplit_variants launches over the same caches."""
    from tests.engine.test_prefill_variants_compiled_ahead import RecordingKernel
    from tpfuse.kernels import decode_attention

    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    recorder = RecordingKernel(decode_attention._decode_split_kernel)
    monkeypatch.setattr(decode_attention, "_decode_split_kernel", recorder)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, seq_lens = random_paged_kv(
        [9, 30, 7], BLOCK, KV_HEADS, HEAD_DIM, torch.float32, gen
    )
    qkv = torch.randn(3 + 5, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q = qkv[:, : HEADS * HEAD_DIM].view(8, HEADS, HEAD_DIM)
    starts = torch.tensor([0, 1, 2, 8], dtype=torch.int32)
    attn = AttentionMetadata(torch.full((8,), -1), tables, seq_lens, starts, 6, 30, False, num_decode_rows=2)
    mixed_attention(q, (k_cache, v_cache), attn, HEAD_DIM**-0.5)
    launched, recorder.keys = recorder.keys, set()
    decode_attention.compile_unsplit_variants(k_cache, v_cache, HEADS)
    assert launched and launched <= recorder.keys, launched - recorder.keys


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_attention_writes_only_the_rows_of_the_out_view_it_is_given(kernels, monkeypatch):
    """attend_paged with out: a strided view (rows of a wider, NaN-poisoned static buffer, as the
    piecewise graphs pass) gets the float64 result; nothing outside the view changes. Mixed, decode
    and prefill steps alike."""
    monkeypatch.setenv("TPFUSE_KERNELS", kernels)
    knobs.reload()
    gen = torch.Generator().manual_seed(11)
    context_lens, query_lens = [7, 21, 12, 5], [1, 1, 5, 3]
    k_cache, v_cache, tables, seq_lens = random_paged_kv(
        context_lens, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, gen
    )
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows, scale = int(starts[-1]), HEAD_DIM**-0.5
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    caches = k_cache.double(), v_cache.double()
    cases = {  # name: (metadata, q rows, reference)
        "mixed": (AttentionMetadata(
            torch.full((rows,), -1), tables, seq_lens, starts, max(query_lens), max(context_lens), False,
            num_decode_rows=2,
        ), q),  # fmt: skip
        "prefill": (AttentionMetadata(
            torch.full((rows,), -1), tables, seq_lens, starts, max(query_lens), max(context_lens), False,
        ), q),  # fmt: skip
        "decode": (AttentionMetadata(
            torch.full((4,), -1), tables, seq_lens, torch.arange(5, dtype=torch.int32), 1, 21, True,
        ), q[:4]),  # fmt: skip
    }
    for name, (attn, q_rows) in cases.items():
        n = q_rows.shape[0]
        static = torch.full((n + 3, HEADS + 1, HEAD_DIM), float("nan"))  # wider rows: a strided view
        out = static[1 : n + 1, :HEADS]
        got = attention.attend_paged(q_rows, (k_cache, v_cache), attn, scale, out)
        assert got.data_ptr() == out.data_ptr(), name
        want = prefill_attention_ref(
            q_rows.double(), *caches, attn.block_tables, attn.seq_lens, attn.query_start_loc,
            attn.max_query_len, scale,
        )  # fmt: skip
        assert_close_to_float64(out, want, torch.float32)
        assert static[0].isnan().all() and static[n + 1 :].isnan().all(), name
        assert static[:, HEADS:].isnan().all(), name
