"""Packing a speculative step: verify rows of k + 1 tokens, per-row draft limits, drafter catch-up
ranges, min_tokens bans at every verified position; the scheduler's lookahead blocks."""

from tpfuse.engine.batch import Ban, Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.spec_inputs import pack_spec_step, read_spec_header, unpack_spec
from tpfuse.engine.step_inputs import read_header, unpack_step

BLOCK, K = 4, 3


def _batch(decode_max_tokens=16, min_tokens=0):
    bm = BlockManager(64, BLOCK)
    decode = Sequence(
        "d", list(range(1, 8)), SamplingParams(max_tokens=decode_max_tokens, min_tokens=min_tokens), BLOCK
    )
    chunk = Sequence("c", list(range(20, 31)), SamplingParams(), BLOCK)
    for seq in (decode, chunk):
        bm.allocate(seq)
    bm.append_slot(decode, K)
    decode.num_prompt_tokens = 5  # 2 tokens generated so far
    decode.num_computed_tokens, decode.num_drafter_tokens = 6, 4
    chunk.num_computed_tokens, chunk.num_drafter_tokens = 4, 0
    return Batch([decode, chunk], [1, 3])


def _unpack(packed):
    header = read_header(packed)
    return unpack_step(header, packed), unpack_spec(header, read_spec_header(packed, header), packed)


def test_decode_row_carries_its_newest_token_and_k_draft_slots_at_the_next_positions():
    batch = _batch()
    decode = batch.seqs[0]
    step, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, max_model_len=64))
    assert step.input_ids[:4].tolist() == [7, 0, 0, 0]  # drafts are written on the device
    assert step.positions.tolist()[:4] == [6, 7, 8, 9]
    assert step.slot_mapping[:4].tolist() == [
        decode.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(6, 10)
    ]
    assert step.seq_lens.tolist() == [10, 7]
    assert spec.verify_indices.tolist() == [0, 1, 2, 3]
    assert spec.num_drafts.tolist() == [3]
    assert step.header.num_samples == 0  # the chunk does not reach its end; the decode is verified
    assert spec.header.num_draft_tokens == K and spec.header.pure_decode == 0


def test_rows_near_max_model_len_use_fewer_drafts_and_store_no_kv_for_the_rest():
    batch = _batch()  # 7 ids: within max_model_len 9 this step may emit 2 tokens, so 1 draft
    step, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, max_model_len=9))
    assert spec.num_drafts.tolist() == [1]
    assert step.slot_mapping[2:4].tolist() == [-1, -1]


def test_rows_near_max_tokens_draft_in_full():
    """Postprocessing cuts the tokens past max_tokens; a draft count that depended on the row's
    output length would depend on the acceptance of the step before (chained steps cannot know it)."""
    batch = _batch(decode_max_tokens=3)  # 2 generated: one more token ends the row
    step, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, max_model_len=64))
    assert spec.num_drafts.tolist() == [K]
    assert (step.slot_mapping[:4] >= 0).all()


def test_host_drafts_fill_the_verify_row():
    batch = _batch()
    step, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, 64, host_drafts={0: [40, 41]}))
    assert step.input_ids[:4].tolist() == [7, 40, 41, 0]
    assert spec.draft_ids.tolist() == [40, 41, 0] and spec.num_drafts.tolist() == [2]
    assert step.slot_mapping[3].item() == -1


def test_drafter_rows_cover_the_positions_the_drafter_lags_behind():
    batch = _batch()
    _, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, max_model_len=64))
    assert spec.drafter_rows.tolist() == [0, 1]
    assert spec.ext_positions.tolist() == [4, 5, 0, 1, 2, 3]
    assert spec.ext_input_ids.tolist() == [5, 6, 20, 21, 22, 23]
    assert spec.ext_next_ids.tolist() == [6, 7, 21, 22, 23, 24]
    assert spec.ext_query_start_loc.tolist() == [0, 2, 6]
    assert spec.decode_drafter_index.tolist() == [0]


def test_min_tokens_bans_every_verify_position_before_min_tokens():
    batch = _batch(min_tokens=4)  # 2 generated: positions 0 and 1 of the verify row are banned
    batch.bans = {0: Ban([9, 11], 2)}
    _, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, max_model_len=64))
    assert list(zip(spec.banned_rows.tolist(), spec.banned_ids.tolist(), strict=True)) == [
        (0, 9), (0, 11), (1, 9), (1, 11),
    ]  # fmt: skip


def test_scheduler_reserves_lookahead_blocks_for_decodes_and_charges_them_to_the_budget():
    bm = BlockManager(64, BLOCK)
    scheduler = Scheduler(bm, 8, 6, 64, {0}, num_lookahead_tokens=K)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(), BLOCK) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.postprocess_multi(batch, [[5], [6]])
    scheduler.max_num_batched_tokens = 1 + K  # each decode takes 1 + K tokens of the budget
    batch = scheduler.schedule()
    assert len(batch.seqs) == 1 and batch.num_new_tokens == [1]
    assert len(batch.seqs[0].block_table) * BLOCK >= len(batch.seqs[0]) + K


def _decode_only_batch(lags=(1, 4), lengths=(9, 12)):
    bm = BlockManager(64, BLOCK)
    seqs = []
    for i, (lag, length) in enumerate(zip(lags, lengths, strict=True)):
        seq = Sequence(
            f"w{i}",
            list(range(100 * i + 1, 100 * i + 1 + length)),
            SamplingParams(max_tokens=32, temperature=0.0),
            BLOCK,
        )
        bm.allocate(seq)
        bm.append_slot(seq, K)
        seq.num_prompt_tokens = length - 2
        seq.num_computed_tokens = length - 1
        seq.num_drafter_tokens = length - 1 - lag
        seqs.append(seq)
    return Batch(seqs, [1] * len(seqs))


def test_a_window_step_gives_every_row_the_window_ending_at_its_newest_verified_position():
    batch = _decode_only_batch()
    step, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, 64, pad_to=3, ext_window=K + 1))
    h = spec.header
    assert h.ext_window == K + 1 and h.num_extend == 3 * (K + 1)
    for row, seq in enumerate(batch.seqs):
        begin, window = seq.num_computed_tokens, slice(row * (K + 1), (row + 1) * (K + 1))
        assert spec.ext_positions[window].tolist() == list(range(begin - K - 1, begin))
        assert spec.ext_next_ids[window].tolist() == seq.token_ids[begin - K : begin + 1]
        table = seq.block_table
        assert spec.ext_slots[window].tolist() == [
            table[p // BLOCK] * BLOCK + p % BLOCK for p in range(begin - K - 1, begin)
        ]
    padding = slice(2 * (K + 1), 3 * (K + 1))
    assert spec.ext_slots[padding].tolist() == [-1] * (K + 1)  # the padding row stores nothing
    assert spec.ext_positions[padding].tolist() == list(range(K + 1))


def test_a_step_that_cannot_be_a_window_step_keeps_the_lagging_ranges():
    for batch in (_decode_only_batch(lags=(1, 5)), _decode_only_batch(lengths=(4, 12)), _batch()):
        packed = pack_spec_step(batch, BLOCK, 0, K, 64, ext_window=K + 1)
        _, spec = _unpack(packed)
        assert spec.header.ext_window == 0


def test_decode_rows_lagging_beyond_the_budget_catch_up_only_their_newest_positions():
    batch = _decode_only_batch(lags=(50, 1), lengths=(60, 12))
    _, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, 64, catch_up_budget=16))
    begin = batch.seqs[0].num_computed_tokens
    assert spec.ext_positions[:8].tolist() == list(range(begin - 8, begin))  # 16 positions / 2 rows
    assert spec.ext_query_start_loc.tolist() == [0, 8, 9]  # the other row lags by one position


def test_lags_within_the_budget_are_caught_up_whole():
    batch = _decode_only_batch(lags=(50, 1), lengths=(60, 12))
    _, spec = _unpack(pack_spec_step(batch, BLOCK, 0, K, 64, catch_up_budget=51))
    assert spec.ext_query_start_loc.tolist() == [0, 50, 51]


def test_only_drafters_that_fell_behind_during_plain_steps_call_for_a_catch_up_step():
    from tpfuse.engine.spec_rows import lags_after_plain_steps

    window = K + 1
    behind = _decode_only_batch(lags=(1, 9), lengths=(12, 20))  # 2 outputs each: plain steps ran
    assert lags_after_plain_steps(behind, window)
    assert not lags_after_plain_steps(_decode_only_batch(lags=(1, 4), lengths=(12, 20)), window)  # within
    just_prefilled = _decode_only_batch(lags=(1, 9), lengths=(12, 20))
    just_prefilled.seqs[1].num_prompt_tokens += 1  # its one output came from the prefill
    assert not lags_after_plain_steps(just_prefilled, window)  # drafts as a fixed k does
    sampled = _decode_only_batch(lags=(1, 9), lengths=(12, 20))
    sampled.seqs[0].params = SamplingParams(max_tokens=32, temperature=0.7)  # no seed: no window step
    assert not lags_after_plain_steps(sampled, window)
    assert not lags_after_plain_steps(_batch(), window)  # a prefill chunk in the batch
