"""Plain decode graphs read the packed step from one static buffer: the graph body (replayed eagerly
on CPU) must hand the model exactly the step's ids (those only the device knows taken from the token
table), positions, slots, context lengths and block table at any table width, and leave each row's
argmax in token_ids and in the token table."""

import torch

from tpfuse.engine.batch import Ban, Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.cuda_graphs import DecodeGraphs
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.step_inputs import decode_capacity, pack_step, read_header, unpack_step

BLOCK = 4
VOCAB = 97
MAX_BLOCKS = 9
SLOTS = 6  # token-table entries of the requests; entry SLOTS is the sink


class RecordingModel:
    """Records the inputs of every forward; logits peak at a token derived from (id, position)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, positions, attn, kv_caches):
        seen = {"input_ids": input_ids, "positions": positions, "slots": attn.slot_mapping}
        seen |= {"seq_lens": attn.seq_lens, "block_tables": attn.block_tables}
        self.seen.append({name: value.clone() for name, value in seen.items()})
        return (input_ids * 31 + positions * 7).double().unsqueeze(1), None

    def compute_logits(self, hidden, out=None):
        target = hidden[:, 0].long() % VOCAB
        logits = torch.randn(hidden.shape[0], VOCAB, dtype=torch.float64).float()
        logits[torch.arange(hidden.shape[0]), target] = 1e4
        return logits if out is None else out.copy_(logits)


class EagerGraph:
    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


class EagerGraphs(DecodeGraphs):
    def _capture_graph(self, body, pool):
        return EagerGraph(body), pool


def _graphs():
    kv = [(torch.zeros(64, BLOCK, 1, 2), torch.zeros(64, BLOCK, 1, 2))]
    table = torch.zeros(SLOTS + 1, dtype=torch.int64)
    graphs = EagerGraphs(RecordingModel(), kv, 4, MAX_BLOCKS, MAX_BLOCKS * BLOCK, VOCAB, token_table=table)
    graphs.capture()
    graphs.model.seen.clear()
    return graphs


def _decode_step(
    lengths: list[int], pad_to: int, first_block: int = 0, ahead: bool = False
) -> tuple[Batch, torch.Tensor]:
    """A decode of rows of these lengths in slots SLOTS-1, SLOTS-2, ...; ahead: planned while the
    step before ran (each row's id is still on the device: the token table's)."""
    bm = BlockManager(64, BLOCK, enable_prefix_caching=False)
    for _ in range(first_block):  # shifts which blocks the sequences get
        bm.allocate(Sequence("filler", [1] * BLOCK, SamplingParams(), BLOCK))
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(
            f"r{i}", [(3 * i + j) % VOCAB for j in range(n)], SamplingParams(temperature=0.0), BLOCK
        )
        bm.allocate(seq)
        seq.num_computed_tokens = n - 1
        seq.slot = SLOTS - 1 - i
        seqs.append(seq)
    # Ahead: the step before (at position n - 1) is sampling the token at position n.
    batch = Batch(seqs, [1] * len(seqs), begins=list(lengths) if ahead else None)
    return batch, pack_step(batch, BLOCK, 0, pad_to=pad_to, table_sink=SLOTS)


def _poison(graphs):
    graphs.block_tables.fill_(-7)
    graphs.seq_lens.fill_(-7)
    graphs.token_ids.fill_(-7)


def _assert_model_saw(graphs, packed, input_ids=None):
    step = unpack_step(read_header(packed), packed)
    seen = graphs.model.seen[-1]
    width = step.header.max_blocks
    input_ids = step.input_ids if input_ids is None else input_ids
    assert torch.equal(seen["input_ids"], input_ids)
    assert torch.equal(seen["positions"], step.positions)
    assert torch.equal(seen["slots"], step.slot_mapping)
    assert seen["seq_lens"].tolist() == step.seq_lens.tolist()
    assert seen["block_tables"][:, :width].tolist() == step.block_tables.tolist()
    expected = (input_ids * 31 + step.positions * 7) % VOCAB
    assert graphs.token_ids[: step.header.num_seqs].tolist() == expected.tolist()
    rows = read_header(packed).num_samples
    assert graphs.token_table[SLOTS - rows : SLOTS].flip(0).tolist() == expected[:rows].tolist()


def test_decode_graph_reads_a_wide_then_a_narrow_step_from_the_packed_buffer():
    graphs = _graphs()
    for lengths, pad_to, first_block in [([30, 3, 9], 4, 0), ([2, 5], 2, 5), ([7], 1, 11)]:
        _, packed = _decode_step(lengths, pad_to, first_block)
        _poison(graphs)
        graphs.packed[: packed.numel()].copy_(packed)
        graphs.replay_packed(pad_to)
        _assert_model_saw(graphs, packed)


def test_decode_graph_takes_ids_only_the_device_knows_from_the_token_table():
    graphs = _graphs()
    _, packed = _decode_step([30, 3, 9], 4, ahead=True)
    graphs.token_table[: SLOTS + 1] = torch.arange(SLOTS + 1) + 40  # what the step before sampled
    _poison(graphs)
    graphs.packed[: packed.numel()].copy_(packed)
    graphs.replay_packed(4)
    assert unpack_step(read_header(packed), packed).positions.tolist() == [30, 3, 9, 0]
    _assert_model_saw(graphs, packed, input_ids=torch.tensor([45, 44, 43, 0]))  # the padding row: 0


def test_run_copies_a_step_held_elsewhere_into_the_packed_layout():
    graphs = _graphs()
    _, wide = _decode_step([30, 30, 30, 30], 4)
    graphs.packed[: wide.numel()].copy_(wide)
    graphs.replay_packed(4)
    _, packed = _decode_step([6, 2, 11], 4, first_block=3)
    _poison(graphs)
    graphs.run(unpack_step(read_header(packed), packed.clone()))
    _assert_model_saw(graphs, packed)


def test_capture_stores_no_kv_and_sees_one_token_contexts():
    graphs = EagerGraphs(RecordingModel(), [(torch.zeros(2, BLOCK, 1, 2),) * 2], 2, MAX_BLOCKS, 36, VOCAB)
    graphs.capture()
    for seen in graphs.model.seen:
        assert seen["slots"].tolist() == [-1] * len(seen["slots"])
        assert seen["seq_lens"].tolist() == [1] * len(seen["seq_lens"])
        assert seen["block_tables"].eq(0).all()


def test_decode_capacity_holds_the_largest_step_with_its_banned_pairs_and_token_table_entries():
    bm = BlockManager(64, BLOCK, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, min_tokens=5)
    seqs = []
    for i in range(4):
        seq = Sequence(f"r{i}", [1] * (MAX_BLOCKS * BLOCK - 1), params, BLOCK)
        bm.allocate(seq)
        seq.num_computed_tokens = len(seq) - 1
        seq.slot = i
        seqs.append(seq)
    bans = {row: Ban([0, 1, 2], 5) for row in range(4)}
    ahead = Batch(seqs, [1] * 4, bans, begins=[len(s) for s in seqs])  # every id from the table
    packed = pack_step(ahead, BLOCK, 0, table_sink=4)
    assert read_header(packed).num_gathered == 4
    assert packed.numel() == decode_capacity(4, MAX_BLOCKS, 12)
