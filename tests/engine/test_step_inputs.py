"""Packing a step: per-row seeds, layout round trip, CUDA-graph padding."""

import torch

from tpfuse.engine.batch import Ban, Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.step_inputs import pack_step, read_header, row_seed, unpack_step

BLOCK = 4


def test_seeded_row_seed_depends_only_on_seed_and_output_index():
    assert row_seed(5, engine_seed=0, seq_id=1, output_index=3) == row_seed(5, 99, 42, 3)
    assert row_seed(5, 0, 1, 3) != row_seed(5, 0, 1, 4)
    assert row_seed(5, 0, 1, 3) != row_seed(6, 0, 1, 3)


def test_unseeded_row_seed_differs_per_sequence_and_engine_seed():
    assert row_seed(None, 0, 1, 0) != row_seed(None, 0, 2, 0)
    assert row_seed(None, 0, 1, 0) != row_seed(None, 1, 1, 0)
    assert 0 <= row_seed(None, 0, 1, 0) < 2**63


def _batch():
    bm = BlockManager(32, BLOCK)
    sampled = SamplingParams(temperature=0.5, top_p=0.8, top_k=3, seed=1, min_tokens=3)
    decode = Sequence("d", list(range(1, 7)), sampled, BLOCK)
    chunk = Sequence("c", list(range(10, 21)), SamplingParams(temperature=0.0), BLOCK)
    for s in (decode, chunk):
        bm.allocate(s)
    decode.num_computed_tokens = 5
    chunk.num_computed_tokens = 4
    return Batch([decode, chunk], [1, 3])


def test_pack_then_unpack_gives_positions_slots_and_sampling_rows():
    batch = _batch()
    batch.bans = {0: Ban([7], 3)}  # row 0 ("d") bans id 7 (min_tokens)
    packed = pack_step(batch, BLOCK, engine_seed=0)
    step = unpack_step(read_header(packed), packed)
    decode, chunk = batch.seqs
    assert step.input_ids.tolist() == [6, 14, 15, 16]
    assert step.positions.tolist() == [5, 4, 5, 6]
    expected_slots = [decode.block_table[1] * BLOCK + 1]
    expected_slots += [chunk.block_table[1] * BLOCK + i for i in range(3)]
    assert step.slot_mapping.tolist() == expected_slots
    assert step.seq_lens.tolist() == [6, 7]
    assert step.query_start_loc.tolist() == [0, 1, 4]
    assert step.block_tables[0, :2].tolist() == list(decode.block_table)
    assert step.sample_indices.tolist() == [0]  # the chunk does not reach its last token
    assert step.temperatures.tolist() == [0.5] and step.top_ks.tolist() == [3]
    assert torch.allclose(step.top_ps, torch.tensor([0.8]))
    assert step.banned_rows.tolist() == [0] and step.banned_ids.tolist() == [7]
    assert step.header.all_greedy == 0 and step.header.is_decode == 0
    assert step.header.decode_rows == 1 and step.attention_metadata().num_decode_rows == 1


def test_a_mixed_batch_moves_its_one_token_rows_first_with_their_bans_and_begins():
    seqs = [Sequence(f"s{i}", list(range(1, 9)), SamplingParams(), BLOCK) for i in range(4)]
    batch = Batch(seqs, [5, 1, 3, 1], {1: Ban([7], 2), 2: Ban([9], 1)}, [0, 7, 2, 7])
    ordered = batch.decodes_first()
    assert [s.request_id for s in ordered.seqs] == ["s1", "s3", "s0", "s2"]
    assert ordered.num_new_tokens == [1, 1, 5, 3] and ordered.begins == [7, 7, 0, 2]
    assert ordered.bans == {0: batch.bans[1], 3: batch.bans[2]}
    assert ordered.decodes_first() is ordered and Batch(seqs[:2], [1, 1]).decodes_first().seqs == seqs[:2]


def test_decode_batch_padded_to_a_bucket_has_inert_padding_rows():
    bm = BlockManager(32, BLOCK)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0), BLOCK) for i in range(3)]
    for s in seqs:
        bm.allocate(s)
        s.num_computed_tokens = 2
    packed = pack_step(Batch(seqs, [1, 1, 1]), BLOCK, 0, pad_to=8)
    step = unpack_step(read_header(packed), packed)
    assert step.header.num_seqs == 8 and step.header.num_samples == 3
    assert step.slot_mapping[3:].tolist() == [-1] * 5
    assert step.seq_lens[3:].tolist() == [1] * 5
    assert step.query_start_loc.tolist() == list(range(9))
    assert step.block_tables[3:].abs().sum() == 0
    assert step.header.all_greedy == 1 and step.header.is_decode == 1
    assert step.header.decode_rows == 8  # padding rows included


def test_a_batch_planned_ahead_packs_as_after_the_tokens_arrive_but_takes_them_from_the_table():
    bm = BlockManager(32, BLOCK)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=4),
        SamplingParams(temperature=1.0),
    ]
    seqs = [
        Sequence(f"r{i}", list(range(1, n + 1)), p, BLOCK)
        for i, (n, p) in enumerate(zip([3, 4, 9], params, strict=True))
    ]
    for slot, s in zip([4, 0, 2], seqs, strict=True):
        bm.allocate(s)
        s.num_computed_tokens = len(s) - 1
        s.slot = slot
        bm.append_slot(s, 1)  # the next position's block (r1 crosses into a new one)
    ahead_batch = Batch(seqs, [1, 1, 1], begins=[len(s) for s in seqs])
    ahead = pack_step(ahead_batch, BLOCK, engine_seed=9, pad_to=4, table_sink=7)
    for s, token in zip(seqs, [50, 51, 52], strict=True):
        s.token_ids.append(token)
        s.num_computed_tokens += 1
    after = pack_step(Batch(seqs, [1, 1, 1]), BLOCK, engine_seed=9, pad_to=4, table_sink=7)
    got, expected = read_header(ahead), read_header(after)
    assert (got.num_gathered, expected.num_gathered) == (3, 0)
    got.num_gathered = 0
    assert got == expected
    got = unpack_step(read_header(ahead), ahead)
    assert got.id_slots.tolist() == [4, 0, 2, -1]  # the padding row reads its packed 0
    assert got.write_slots.tolist() == [4, 0, 2, 7]  # ... and writes the sink
    table = torch.zeros(8, dtype=torch.int64)
    table[[4, 0, 2]] = torch.tensor([50, 51, 52])
    got.input_ids.copy_(torch.where(got.id_slots >= 0, table[got.id_slots.clamp(min=0)], got.input_ids))
    expected = unpack_step(read_header(after), after)
    assert expected.id_slots.tolist() == [-1] * 4
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables",
                 "sample_indices", "top_ks", "seeds", "temperatures", "top_ps", "write_slots"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_a_prompt_chunk_planned_ahead_packs_its_known_ids_and_its_sampled_token_goes_to_its_slot():
    bm = BlockManager(32, BLOCK)
    seq = Sequence("r", list(range(1, 12)), SamplingParams(temperature=0.0), BLOCK)
    bm.allocate(seq)
    seq.slot = 1
    packed = pack_step(Batch([seq], [5], begins=[6]), BLOCK, engine_seed=0, table_sink=3)
    step = unpack_step(read_header(packed), packed)
    assert step.input_ids.tolist() == list(range(7, 12)) and step.positions.tolist() == list(range(6, 11))
    assert step.header.num_gathered == 0 and step.id_slots.tolist() == [-1] * 5
    assert step.write_slots.tolist() == [3, 3, 3, 3, 1]  # only the last token's logits are sampled
    seq.slot = None  # a row without a slot (a benchmark's batch) writes the sink
    packed = pack_step(Batch([seq], [4], begins=[6]), BLOCK, engine_seed=0, table_sink=3)
    assert unpack_step(read_header(packed), packed).write_slots.tolist() == [3] * 4
    without_table = pack_step(Batch([seq], [5], begins=[6]), BLOCK, engine_seed=0)
    assert read_header(without_table).uses_table == 0
    assert unpack_step(read_header(without_table), without_table).id_slots.numel() == 0
