"""Chained speculative steps (engine/spec_chain.py): a template packed while the step before runs,
shifted on the device by that step's accepted counts, equals the step packed synchronously after it;
the engine's chained path gives the synchronous path's tokens."""

import random
from types import SimpleNamespace

import pytest
import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.batch import Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.spec_chain import TEMPLATE_TOKEN, continued_results, shift_by_accepted, template_batch
from tpfuse.engine.spec_inputs import pack_spec_step, read_spec_header, unpack_spec
from tpfuse.engine.step_inputs import read_header, unpack_step

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head

BLOCK, K, WINDOW = 4, 3, 4
# Fields that depend on acceptance and that the shift recomputes; the rest must be equal as packed.
# seeds (rejection sampling's per-step seeds) are left stale: chained steps verify greedily or simulate.
STALE = {"seeds"}


def _decoding_batch(rng: random.Random, rows: int) -> Batch:
    bm = BlockManager(256, BLOCK)
    seqs = []
    for i in range(rows):
        prompt = [rng.randrange(1, 100) for _ in range(rng.randrange(6, 20))]
        seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=64), BLOCK)
        bm.allocate(seq)
        seq.token_ids += [rng.randrange(1, 100) for _ in range(rng.randrange(0, 5))]
        seq.num_computed_tokens = len(seq.token_ids) - 1
        seq.num_drafter_tokens = seq.num_computed_tokens - rng.randrange(0, WINDOW)
        bm.append_slot(seq, 2 * K + 1)  # what schedule_next_spec_decode reserves
        seqs.append(seq)
    return Batch(seqs, [1] * rows)


def _pack(batch: Batch, k: int, pad_to: int) -> torch.Tensor:
    return pack_spec_step(batch, BLOCK, 7, k, 1024, pad_to=pad_to, ext_window=WINDOW)


def _unpack(packed: torch.Tensor):
    header = read_header(packed)
    return unpack_step(header, packed), unpack_spec(header, read_spec_header(packed, header), packed)


def _fields(inputs) -> dict:
    return {name: value for name, value in vars(inputs).items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("leave_out", [False, True])
def test_a_shifted_template_equals_the_step_packed_after_the_accepted_tokens(seed, leave_out):
    """leave_out: rows of the step before finished while it ran; the template holds the others,
    which take their shifts from the rows they continue."""
    rng = random.Random(seed)
    rows, k_before, k = rng.randrange(1, 5), rng.randrange(0, K + 1), rng.randrange(1, K + 1)
    before = _decoding_batch(rng, rows + leave_out)
    kept = sorted(rng.sample(range(len(before.seqs)), rows))
    batch = Batch([before.seqs[row] for row in kept], [1] * rows)
    pad_to = rows + rng.randrange(0, 3)
    template = _pack(template_batch(batch), k, pad_to)
    step, spec = _unpack(template.clone())
    assert spec.header.ext_window == WINDOW
    accepted = [rng.randrange(0, k_before + 1) for _ in before.seqs]
    emitted = torch.full((len(before.seqs), k_before + 1), -1, dtype=torch.int64)
    for row, (seq, a) in enumerate(zip(before.seqs, accepted, strict=True)):
        tokens = [rng.randrange(100, 200) for _ in range(a + 1)]
        emitted[row, : a + 1] = torch.tensor(tokens)
        seq.num_drafter_tokens = seq.num_computed_tokens  # as SpecDecoder.wait leaves it
        seq.token_ids += tokens
        seq.num_computed_tokens += a + 1
    result = SimpleNamespace(num_accepted=torch.tensor(accepted), token_ids=emitted)
    shift_by_accepted(step, spec, *continued_results(before, batch, result), BLOCK, k_before)
    expected_step, expected_spec = _unpack(_pack(batch, k, pad_to))
    for (name, got), want in zip(
        [*_fields(step).items(), *_fields(spec).items()],
        [*_fields(expected_step).values(), *_fields(expected_spec).values()],
        strict=True,
    ):
        if name not in STALE:
            assert torch.equal(got, want), name
    assert step.header.max_seq_len >= expected_step.header.max_seq_len
    assert spec.header.ext_max_seq_len >= expected_spec.header.ext_max_seq_len


def test_the_template_holds_a_placeholder_where_the_newest_id_goes():
    batch = _decoding_batch(random.Random(0), 1)
    seq = batch.seqs[0]
    step, spec = _unpack(_pack(template_batch(batch), K, 1))
    assert step.input_ids[0].item() == TEMPLATE_TOKEN
    assert step.positions[0].item() == len(seq)  # one position past the newest known id
    assert spec.ext_next_ids[-1].item() == TEMPLATE_TOKEN
    assert spec.ext_next_ids[:-1].tolist() == seq.token_ids[-(WINDOW - 1) :]


def test_a_template_sees_the_ids_with_one_placeholder_appended():
    from tpfuse.engine.spec_chain import _WithOneMore

    ids = [5, 6, 7]
    view, expected = _WithOneMore(ids), [5, 6, 7, TEMPLATE_TOKEN]
    assert len(view) == 4 and list(view) == expected
    for i in range(-4, 4):
        assert view[i] == expected[i]
    for a in range(5):
        for b in range(5):
            assert view[a:b] == expected[a:b]
    assert view[1:] == expected[1:] and view[:-1] == expected[:-1]
    for bad in (4, -5):
        with pytest.raises(IndexError):
            view[bad]


def test_only_a_window_step_of_the_same_decode_rows_can_be_shifted():
    batch = _decoding_batch(random.Random(1), 2)
    step, spec = _unpack(pack_spec_step(template_batch(batch), BLOCK, 7, K, 1024))
    with pytest.raises(ValueError, match="window step of the same decode rows"):
        shift_by_accepted(step, spec, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1), BLOCK, 0)


def _scheduler_with(*seqs: Sequence, max_model_len: int = 1024) -> Scheduler:
    """A scheduler whose running requests are seqs, each decoding its first output token."""
    scheduler = Scheduler(
        BlockManager(64, BLOCK), 8, 64, max_model_len, eos_token_ids={2}, num_lookahead_tokens=K
    )
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(5)  # decoding now
    return scheduler


def test_the_next_speculative_decode_reserves_blocks_for_the_largest_shift():
    seq = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=64), BLOCK)
    scheduler = _scheduler_with(seq)
    following = scheduler.schedule_next_spec_decode(Batch([seq], [1]))
    assert following is not None and following.num_new_tokens == [1]
    assert len(seq.block_table) * BLOCK >= len(seq) + 2 * K + 1


@pytest.mark.parametrize(
    ("params", "max_model_len", "why"),
    [
        (SamplingParams(max_tokens=64), 10 + 2 * K + 1, "max_model_len within two steps"),
        (SamplingParams(max_tokens=64, min_tokens=3), 1024, "min_tokens still bans ids"),
    ],
)
def test_no_next_speculative_decode_when_acceptance_could_change_it(params, max_model_len, why):
    seq = Sequence("a", list(range(1, 10)), params, BLOCK)
    scheduler = _scheduler_with(seq, max_model_len=max_model_len)
    assert scheduler.schedule_next_spec_decode(Batch([seq], [1])) is None, why


def test_rows_near_max_tokens_chain_while_a_row_surely_outlives_the_step_in_flight():
    """A row near max_tokens may finish in the step in flight (its tokens past max_tokens are cut in
    postprocessing, and its draft count does not depend on them): it is chained if another row is
    sure to go on; a row that the step's first token finishes is left out."""
    near, sure, last = (Sequence(n, list(range(1, 10)), SamplingParams(max_tokens=m), BLOCK) for n, m in
                        (("near", K + 2), ("sure", K + 3), ("last", 2)))  # fmt: skip
    scheduler = _scheduler_with(near, sure, last)  # K + 1, K + 2 and 1 tokens to go
    following = scheduler.schedule_next_spec_decode(Batch([near, sure, last], [1, 1, 1]))
    assert following is not None and following.seqs == [near, sure]
    near, last = (Sequence(n, list(range(1, 10)), SamplingParams(max_tokens=m), BLOCK) for n, m in
                  (("near", K + 2), ("last", 2)))  # fmt: skip
    scheduler = _scheduler_with(near, last)
    assert scheduler.schedule_next_spec_decode(Batch([near, last], [1, 1])) is None  # none surely goes on


def test_the_next_speculative_decode_leaves_out_rows_that_finished():
    a, b, c = (Sequence(name, list(range(1, 10)), SamplingParams(max_tokens=64), BLOCK) for name in "abc")
    scheduler = _scheduler_with(a, b, c)
    scheduler.finish(b, "stop")
    following = scheduler.schedule_next_spec_decode(Batch([a, b, c], [1, 1, 1]))
    assert following is not None and following.seqs == [a, c] and following.num_new_tokens == [1, 1]
    scheduler.finish(a, "stop")
    scheduler.finish(c, "length")
    assert scheduler.schedule_next_spec_decode(Batch([a, b, c], [1, 1, 1])) is None  # nobody left


def test_no_next_speculative_decode_while_a_request_waits():
    seq = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=64), BLOCK)
    scheduler = _scheduler_with(seq)
    scheduler.add(Sequence("b", [1, 2, 3], SamplingParams(), BLOCK))
    assert scheduler.schedule_next_spec_decode(Batch([seq], [1])) is None


def _count_chained(llm) -> dict:
    decoder = llm.engine.spec_decoder
    counts = {"chained": 0, "launched": 0, "left_out_rows": 0}
    launch = decoder.launch

    def counting(batch, *args, previous=None, **kwargs):
        counts["launched"] += 1
        counts["chained"] += previous is not None
        if previous is not None:
            counts["left_out_rows"] += len(previous.batch.seqs) - len(batch.seqs)
        return launch(batch, *args, previous=previous, **kwargs)

    decoder.launch = counting
    return counts


@pytest.mark.parametrize("adaptive", [False, True])
def test_chained_steps_give_plain_greedy_tokens(tmp_path, adaptive):
    kw = {**ENGINE, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS, greedy(40))]
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config("eagle3", path, adaptive=adaptive)))
    counts = _count_chained(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(40))] == expected
    assert counts["chained"] >= counts["launched"] // 3, counts


def _simulated_runs(path: str, params) -> tuple[dict, dict]:
    """PROMPTS generated synchronously (False) and chained (True) with simulated acceptance length 3:
    (token ids per prompt, launch counts) per mode."""
    outputs, counts = {}, {}
    for chain in (False, True):
        kw = {**ENGINE, "enable_prefix_caching": False, "disable_overlap_schedule": not chain}
        spec = spec_config("eagle3", path, adaptive=False, simulate_acceptance_length=3.0)
        llm = LLM(config=EngineConfig(**kw, speculative=spec))
        counts[chain] = _count_chained(llm)
        outputs[chain] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.spec_decoder.stats.acceptance_length > 2.0
    return outputs, counts


def test_chained_steps_accept_what_synchronous_steps_accept(tmp_path):
    """With simulated acceptance (drafts accepted whatever the target says) rows shift by 0..k each
    step; the chained engine must emit exactly the synchronous engine's tokens, drafts included."""
    # seeded: an unseeded request's draws mix in its sequence id, which differs between engines
    outputs, counts = _simulated_runs(write_eagle3_head(str(tmp_path)), greedy(40, seed=11))
    assert counts[False]["chained"] == 0 and counts[True]["chained"] > 4, counts
    assert outputs[True] == outputs[False]


def test_a_row_that_stops_while_the_next_step_is_in_flight_wastes_no_step(tmp_path):
    """r1 stops on a token mid-run: the chained step already launched keeps serving the other rows
    (the stopped row's tokens are discarded), so the chained engine launches exactly as many steps
    as the synchronous one, and every request gets the same tokens."""
    kw = {**ENGINE, "enable_prefix_caching": False}
    plain = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:3], greedy(30))]
    late = next(i for i in range(15, 30) if plain[1][i] not in plain[1][:i])  # chaining by then
    params = [greedy(30), greedy(30, stop_token_ids=[plain[1][late]]), greedy(30)]
    path = write_eagle3_head(str(tmp_path))
    outputs, counts = {}, {}
    for chain in (False, True):
        config = EngineConfig(
            **kw, disable_overlap_schedule=not chain, speculative=spec_config("eagle3", path, adaptive=False)
        )
        llm = LLM(config=config)
        counts[chain] = _count_chained(llm)
        outputs[chain] = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == plain[0] and len(outputs[True][1]) == late + 1
    assert counts[True]["chained"] > 4
    assert counts[True]["launched"] == counts[False]["launched"], counts


def test_the_chain_goes_on_past_rows_that_finish(tmp_path):
    """Requests with different max_tokens finish at different steps, and each finish lands in a step
    whose successor is already in flight: that successor is kept, the chained step after it leaves
    the finished row out, and every request gets the synchronous engine's tokens."""
    params = [greedy(n, seed=11) for n in (19, 26, 33, 40)]
    outputs, counts = _simulated_runs(write_eagle3_head(str(tmp_path)), params)
    assert outputs[True] == outputs[False]
    assert [len(tokens) for tokens in outputs[True]] == [19, 26, 33, 40]
    # r0 finishes before the chain starts (r3's prompt is still prefilled in chunks), r3 last
    assert counts[True]["left_out_rows"] == 2, counts
    assert counts[True]["launched"] == counts[False]["launched"], counts
