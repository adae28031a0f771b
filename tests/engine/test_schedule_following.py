"""Scheduler.schedule_following plans the step after a batch in flight from where that batch leaves
each row: when no row stops on a token, it is the batch schedule() returns once that batch is
postprocessed (same rows, same chunks, arrivals admitted, rows finished by length left out), each
row starting where postprocessing leaves it. When it cannot plan (a KV block would have to be freed),
it returns None and changes nothing."""

import copy

from tpfuse.engine.batch import Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.sequence import Sequence

BLOCK = 4


def fake_token(seq: Sequence) -> int:  # a deterministic "model": never an EOS or stop id
    return (sum(seq.token_ids[-3:]) * 31 + len(seq.token_ids)) % 500


def sample(batch: Batch) -> list[int | None]:
    return [fake_token(s) if batch.samples(i) else None for i, s in enumerate(batch.seqs)]


def scheduler(num_blocks=512, budget=20, prefill=12):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(bm, 64, budget, 4096, {999}, max_prefill_tokens_per_step=prefill)


def add(sched: Scheduler, i: int, length: int, max_tokens: int) -> None:
    prompt = [(17 * i + 5 * j) % 400 + 1 for j in range(length)]
    sched.add(Sequence(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), BLOCK))


def test_the_planned_batch_is_the_batch_schedule_returns_after_postprocessing():
    sched = scheduler()
    add(sched, 0, 9, 7)
    batch, planned_steps, n = sched.schedule(), 0, 1
    while batch is not None:
        if n < 24:  # arrivals of varied prompt lengths and answer lengths beside the running rows
            add(sched, n, 3 + 7 * (n % 4), 3 + 3 * (n % 5))
        twin, twin_batch = copy.deepcopy((sched, batch))
        twin.postprocess(twin_batch, sample(twin_batch))
        expected = twin.schedule()

        planned = sched.schedule_following(batch)
        sched.postprocess(batch, sample(batch))
        if expected is None:
            assert planned is None
            break
        assert planned is not None
        assert [s.request_id for s in planned.seqs] == [s.request_id for s in expected.seqs]
        assert planned.num_new_tokens == expected.num_new_tokens
        assert planned.begins == [s.num_computed_tokens for s in planned.seqs]
        for seq, twin_seq in zip(planned.seqs, expected.seqs, strict=True):
            assert len(seq.block_table) == len(twin_seq.block_table)
        planned_steps += 1
        batch, n = planned, n + 1
    assert planned_steps > 30 and not sched.has_unfinished()


def test_a_row_the_token_in_flight_finishes_by_length_is_left_out():
    sched = scheduler()
    add(sched, 0, 3, 2)
    add(sched, 1, 3, 9)
    prefill = sched.schedule()  # both prompts: r0 gets its first token now
    planned = sched.schedule_following(prefill)
    sched.postprocess(prefill, sample(prefill))
    decode = sched.schedule_following(planned)  # r0's second token (in flight) is its last
    assert [s.request_id for s in decode.seqs] == ["r1"]


def test_when_a_block_would_have_to_be_freed_nothing_is_planned_and_nothing_changes():
    sched = scheduler(num_blocks=3, budget=32, prefill=32)
    add(sched, 0, 4, 8)  # one full block: its next token needs a second one
    add(sched, 1, 4, 8)
    batch = sched.schedule()
    add(sched, 2, 4, 8)  # waits: no block is free
    assert sched.block_manager.num_free_blocks == 1
    before = ([list(s.block_table) for s in sched.running], [s.request_id for s in sched.waiting])
    assert sched.schedule_following(batch) is None  # two rows need a block, one is free
    after = ([list(s.block_table) for s in sched.running], [s.request_id for s in sched.waiting])
    assert after == before and sched.block_manager.num_free_blocks == 1
