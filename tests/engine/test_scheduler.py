"""Scheduler: budgets, chunked prefill alongside decodes, preemption by recompute, finishing rules.

A fake model stands in for the runner: the next token is a fixed function of the tokens so far, so
any bookkeeping mistake (a lost or repeated chunk, a wrong order) changes the outputs.
"""

import pytest

from tpfuse.engine.batch import Ban
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import GrowthReserve, Scheduler
from tpfuse.engine.sequence import Sequence, SequenceStatus

BLOCK = 4
EOS = 999


def fake_next_token(tokens):
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + 7) % 500


def make(num_blocks=64, max_running=8, budget=64, max_model_len=256, caching=True):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    return Scheduler(bm, max_running, budget, max_model_len, eos_token_ids={EOS})


def add(sched, prompt, request_id="r", **params):
    seq = Sequence(request_id, list(prompt), SamplingParams(**{"max_tokens": 8, **params}), BLOCK)
    sched.add(seq)
    return seq


def step(sched, next_token=fake_next_token):
    batch = sched.schedule()
    assert batch is not None
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq.num_computed_tokens + n <= len(seq)
        assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
    sampled = [next_token(s.token_ids) if batch.samples(i) else None for i, s in enumerate(batch.seqs)]
    sched.postprocess(batch, sampled)
    return batch


def run_all(sched, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not finish")


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    sched = make(budget=4)
    seq = add(sched, range(10))
    chunks = [step(sched).num_new_tokens for _ in range(3)]
    assert chunks == [[4], [4], [2]]
    assert seq.num_output_tokens == 1  # only the last chunk samples


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    sched = make(budget=4)
    short = add(sched, range(3), "short")
    step(sched)  # prefill of the short prompt
    add(sched, range(100, 110), "long")
    batch = step(sched)
    assert [s.request_id for s in batch.seqs] == ["short", "long"]
    assert batch.num_new_tokens == [1, 3]
    assert short.num_output_tokens == 2


def test_running_requests_are_capped_by_max_running_requests():
    sched = make(max_running=2)
    for i in range(4):
        add(sched, range(i, i + 3), f"r{i}")
    batch = step(sched)
    assert len(batch.seqs) == 2 and len(sched.waiting) == 2


def test_waiting_request_is_admitted_when_a_running_one_finishes():
    sched = make(max_running=1)
    first = add(sched, range(3), "a", max_tokens=2)
    second = add(sched, range(5, 8), "b", max_tokens=2)
    step(sched)
    step(sched)
    assert first.is_finished and second.status == SequenceStatus.WAITING
    batch = step(sched)
    assert batch.seqs == [second]


def _outputs(sched, prompts, max_tokens):
    seqs = [add(sched, p, f"r{i}", max_tokens=max_tokens) for i, p in enumerate(prompts)]
    run_all(sched)
    return [s.output_token_ids for s in seqs]


def test_preemption_under_a_tiny_block_budget_gives_the_same_outputs():
    prompts = [list(range(i, i + 5 + 3 * i)) for i in range(5)]
    roomy = make(num_blocks=256)
    tight = make(num_blocks=12)
    expected = _outputs(roomy, prompts, max_tokens=20)
    assert _outputs(tight, prompts, max_tokens=20) == expected
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 12


def test_preemption_without_prefix_caching_gives_the_same_outputs():
    prompts = [list(range(i, i + 6)) for i in range(4)]
    expected = _outputs(make(num_blocks=256), prompts, max_tokens=16)
    tight = make(num_blocks=9, caching=False)
    assert _outputs(tight, prompts, max_tokens=16) == expected
    assert tight.num_preemptions > 0


def test_the_newest_running_request_is_preempted_first():
    sched = make(num_blocks=3)
    old = add(sched, range(4), "old", max_tokens=50)
    new = add(sched, range(10, 14), "new", max_tokens=50)
    step(sched)  # both prefilled: two full blocks, the third block is free
    step(sched)  # old takes the free block; new cannot and is preempted
    assert old.status == SequenceStatus.RUNNING
    assert new.status == SequenceStatus.WAITING and sched.num_preemptions == 1


def test_finishes_on_eos_with_reason_stop():
    sched = make()
    seq = add(sched, range(3))
    step(sched, next_token=lambda t: EOS)
    assert seq.finish_reason == "stop" and seq.output_token_ids == [EOS]
    assert not sched.has_unfinished()


def test_ignore_eos_generates_until_max_tokens():
    sched = make()
    seq = add(sched, range(3), ignore_eos=True, max_tokens=5)
    for _ in range(5):
        step(sched, next_token=lambda t: EOS)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 5


def test_stop_token_ids_finish_with_reason_stop():
    sched = make()
    seq = add(sched, range(3), stop_token_ids=[42])
    step(sched, next_token=lambda t: 41)
    step(sched, next_token=lambda t: 42)
    assert seq.finish_reason == "stop" and seq.output_token_ids == [41, 42]


def test_max_tokens_finishes_with_reason_length():
    sched = make()
    seq = add(sched, range(3), max_tokens=3)
    run_all(sched)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3


def test_max_model_len_finishes_with_reason_length():
    sched = make(max_model_len=6)
    seq = add(sched, range(3), max_tokens=100)
    run_all(sched)
    assert seq.finish_reason == "length" and len(seq) == 6


def test_eos_and_stop_ids_are_banned_until_min_tokens_then_allowed():
    sched = make()
    seq = add(sched, range(3), min_tokens=2, stop_token_ids=[42])
    assert sched.banned_token_ids(seq) == [42, EOS]
    step(sched, next_token=lambda t: 1)
    step(sched, next_token=lambda t: 1)
    assert sched.banned_token_ids(seq) == []


def test_min_tokens_with_ignore_eos_bans_only_stop_ids():
    sched = make()
    seq = add(sched, range(3), min_tokens=2, stop_token_ids=[42], ignore_eos=True)
    assert sched.banned_token_ids(seq) == [42]


def test_finish_of_a_waiting_request_removes_it_and_frees_nothing_twice():
    sched = make(max_running=1)
    add(sched, range(3), "a")
    waiting = add(sched, range(3), "b")
    step(sched)
    sched.finish(waiting, "abort")
    assert waiting not in sched.waiting and waiting.finish_reason == "abort"
    run_all(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_the_scheduled_batch_carries_each_rows_ban_and_how_many_tokens_it_lasts():
    sched = make()
    banning = add(sched, range(3), "a", min_tokens=2, stop_token_ids=[42])
    add(sched, range(4), "b")
    batch = sched.schedule()
    assert batch.seqs[0] is banning and batch.bans == {0: Ban([42, EOS], 2)}


def _with_reserve(num_blocks, ratio, max_running=8):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(
        bm, max_running, 64, 256, eos_token_ids={EOS}, growth_reserve=GrowthReserve(ratio, ratio, 0.0)
    )


def test_admission_keeps_room_for_the_running_requests_growth():
    """At ratio 0.5 a request with 4 prompt tokens and 16 to go reserves 8 tokens (2 blocks of 4):
    of 8 blocks, the first takes 1 + 2, the second 1 + 2, the third would need 1 + 2 of the 2 left."""
    sched = _with_reserve(num_blocks=8, ratio=0.5)
    seqs = [add(sched, range(10 * i, 10 * i + 4), f"r{i}", max_tokens=16, ignore_eos=True) for i in range(3)]
    step(sched)
    assert [s.status for s in seqs] == [
        SequenceStatus.RUNNING,
        SequenceStatus.RUNNING,
        SequenceStatus.WAITING,
    ]
    assert sched.block_manager.num_free_blocks == 6  # 2 taken: the reserve is kept, not allocated


def test_a_lone_request_is_admitted_when_its_prompt_fits_whatever_its_max_tokens():
    sched = _with_reserve(num_blocks=2, ratio=1.0)
    seq = add(sched, range(4), "long", max_tokens=200)
    step(sched)
    assert seq.status == SequenceStatus.RUNNING


def test_a_preemption_raises_the_reserve_and_steps_decay_it():
    reserve = GrowthReserve(init=0.5, minimum=0.1, decay=0.1)
    reserve.step()
    assert reserve.ratio == pytest.approx(0.4)
    reserve.preempted()
    assert reserve.ratio == pytest.approx(0.7)
    for _ in range(20):
        reserve.step()
    assert reserve.ratio == pytest.approx(0.1)
    assert reserve.tokens(7) == 1 and reserve.tokens(-3) == 0


def test_with_the_reserve_a_full_queue_runs_with_fewer_preemptions():
    """Eight requests of 4 + 24 tokens on 32 blocks of 4 (room for four at full length): greedy
    admission preempts over and over; the reserve admits fewer at once and preempts less. Both
    finish every request with the same tokens."""
    results = []
    for reserve in (None, GrowthReserve()):
        bm = BlockManager(32, BLOCK, enable_prefix_caching=False)
        sched = Scheduler(bm, 8, 64, 256, eos_token_ids={EOS}, growth_reserve=reserve)
        seqs = [
            add(sched, range(10 * i, 10 * i + 4), f"r{i}", max_tokens=24, ignore_eos=True) for i in range(8)
        ]
        while sched.has_unfinished():
            step(sched)
        results.append((sched.num_preemptions, [s.output_token_ids for s in seqs]))
    (greedy_preemptions, greedy_tokens), (reserved_preemptions, reserved_tokens) = results
    assert reserved_tokens == greedy_tokens and all(len(t) == 24 for t in greedy_tokens)
    assert greedy_preemptions > 0
    assert reserved_preemptions < greedy_preemptions
