"""Speculative-decoding building blocks on one GPU at llama-3.1-8b shapes (random weights).

Times (median, triton.testing.do_bench):
- verification at the llama-3 vocabulary (128256): greedy, and rejection sampling with the
  filters off and with top-p 0.9 (which sorts the vocabulary), per decode batch and k;
- an EAGLE-3 head of the public llama-3.1-8b shape (hidden 4096, draft vocabulary 32000, bf16):
  the draft extend alone (what a k = 0 step costs to keep the head current) and a whole chain
  propose (extend + k - 1 decode steps, host-built metadata included), per batch and k;
- the AdaptivePolicy's Python bookkeeping per step.
Target verify-pass cost is not here: it is the model's forward with k + 1 tokens per sequence.

Usage (device machine, repo root): python benchmarks/spec.py   # JSON to $OUT/spec.json if set
"""

from __future__ import annotations

import json
import os
import time

import torch
from triton.testing import do_bench

from tpfuse.spec.adaptive import AdaptivePolicy
from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.eagle3 import Eagle3Config, Eagle3Head
from tpfuse.spec.eagle3_drafter import Eagle3Drafter
from tpfuse.spec.verify import greedy_verify, rejection_sample_verify

VOCAB, HIDDEN, DRAFT_VOCAB, BLOCK, CONTEXT = 128256, 4096, 32000, 16, 1024
BATCHES, KS = (1, 8, 64, 128), (1, 3, 5)
ROWS: list[dict] = []


def median_ms(fn, *args) -> float:
    """Median milliseconds of fn(*args) (triton do_bench: warm-up, L2 flushed between calls)."""
    return do_bench(lambda: fn(*args), return_mode="median")


def record(section: str, batch: int, k: int, ms: float, **extra) -> None:
    row = {"section": section, "batch": batch, "k": k, "us": ms * 1e3, **extra}
    ROWS.append(row)
    note = " ".join(f"{n}={v}" for n, v in extra.items())
    print(f"{section:34s} batch {batch:4d} k {k:2d} {ms * 1e3:10.1f} us {note}", flush=True)


def bench_verify() -> None:
    for batch in BATCHES:
        for k in KS:
            logits = torch.randn(batch, k + 1, VOCAB, device="cuda") * 3
            drafts = logits[:, :k].argmax(-1)
            drafts[::2, k // 2] = 0
            seeds = torch.arange(batch, device="cuda")
            temps = torch.full((batch,), 0.8, device="cuda")
            off_k, off_p = torch.full((batch,), -1, device="cuda"), torch.ones(batch, device="cuda")
            record(
                "verify greedy",
                batch,
                k,
                median_ms(greedy_verify, drafts, logits),
            )
            ms = median_ms(rejection_sample_verify, drafts, logits, temps, off_k, off_p, seeds)
            record("verify rejection (no filters)", batch, k, ms)
            top_p = torch.full((batch,), 0.9, device="cuda")
            ms = median_ms(rejection_sample_verify, drafts, logits, temps, off_k, top_p, seeds)
            record("verify rejection (top-p 0.9)", batch, k, ms)


def llama8b_head() -> Eagle3Head:
    config = Eagle3Config(
        hidden_size=HIDDEN,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        dtype=torch.bfloat16,
    )
    with torch.device("cuda"):
        head = Eagle3Head(config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
        hot = torch.randperm(VOCAB, device="cuda", generator=gen)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(hot - torch.arange(DRAFT_VOCAB, device="cuda"))
    return head.eval()


def bench_eagle3() -> None:
    head = llama8b_head()
    embedding = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    for batch in BATCHES[:3]:
        blocks_per_seq = (CONTEXT + 8) // BLOCK + 1
        tables = torch.arange(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
        shape = head.kv_cache_shape(batch * blocks_per_seq, BLOCK)
        kv = tuple(torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        drafter = Eagle3Drafter(head, lambda ids: embedding[ids], kv, VOCAB)
        inputs = DraftInputs(
            input_ids=torch.zeros(batch, dtype=torch.int64, device="cuda"),
            positions=torch.full((batch,), CONTEXT - 1, dtype=torch.int64, device="cuda"),
            next_token_ids=torch.randint(0, VOCAB, (batch,), device="cuda"),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            block_tables=tables,
            block_size=BLOCK,
            target_features=torch.randn(batch, 3 * HIDDEN, device="cuda", dtype=torch.bfloat16),
        )
        record(
            "eagle3 extend only (k=0 step)",
            batch,
            0,
            median_ms(drafter.propose, inputs, 0),
        )
        for k in KS:
            ms = median_ms(drafter.propose, inputs, k)
            record("eagle3 chain propose", batch, k, ms, context=CONTEXT)


def bench_policy() -> None:
    policy = AdaptivePolicy(5, [1, 2, 4, 8, 16, 32, 64, 128])
    accepted = [1, 3, 0, 5] * 16
    start, n = time.perf_counter(), 2000
    for i in range(n):
        k = policy.choose(64)
        policy.record_step(64, k, 0.01 + 1e-4 * (i % 7))
        if k:
            policy.record_acceptance(k, [min(a, k) for a in accepted])
    record("adaptive policy bookkeeping", 64, -1, (time.perf_counter() - start) / n * 1e3)


def main() -> None:
    torch.manual_seed(0)
    bench_verify()
    bench_eagle3()
    bench_policy()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "spec.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": ROWS}, f, indent=1)


if __name__ == "__main__":
    main()
