"""engine/logits_processing.py: logprobs against a float64 softmax of the engine's own logits,
penalties and logit_bias against a float64 reference, and plain batches left alone."""

from types import SimpleNamespace

import pytest
import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.logits_processing import LogitsProcessing
from tpfuse.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_model_len=128))
    yield e
    e.shutdown()


def test_logprobs_match_a_float64_log_softmax_of_the_engines_logits(engine, monkeypatch):
    recorded = []
    model = engine.executor.runner.model
    compute = model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        recorded.append(logits.detach().clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    engine.add_request(
        "lp", [3, 1, 4, 1, 5], SamplingParams(temperature=0.7, seed=3, max_tokens=5, logprobs=5)
    )
    entries, tokens = [], []
    while engine.has_unfinished():
        for output in engine.step():
            entries += output.logprobs
            tokens += output.new_token_ids
    assert len(entries) == len(recorded) == len(tokens) == 5
    for entry, logits, token in zip(entries, recorded, tokens, strict=True):
        reference = torch.log_softmax(logits[-1].double(), dim=-1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        top_values, top_ids = reference.topk(5)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-5)


class _Seq:
    """What logits processing reads of a Sequence."""

    def __init__(self, params: SamplingParams, prompt: list[int], output: list[int]):
        self.params, self.token_ids, self.output_token_ids = params, prompt + output, output
        self.num_prompt_tokens = len(prompt)

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)


_seq = _Seq


def _reference(logits: torch.Tensor, seq) -> torch.Tensor:
    """float64: HF repetition penalty over every token, OpenAI presence/frequency over output, bias."""
    p, out = seq.params, logits.double().clone()
    for t in set(seq.token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(seq.output_token_ids):
        out[t] -= p.frequency_penalty * seq.output_token_ids.count(t) + p.presence_penalty
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    return out


def test_penalties_and_bias_match_a_float64_reference():
    vocab = 37
    processing = LogitsProcessing(vocab, tokenizer=None, eos_token_ids=[1])
    seqs = [
        _seq(SamplingParams(repetition_penalty=1.3), [2, 5, 5], [7, 2]),
        _seq(SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), [3], [4, 4, 9, 4]),
        _seq(SamplingParams(), [1], [2]),  # plain: untouched
        _seq(
            SamplingParams(logit_bias={0: 5.0, 36: -100.0}, repetition_penalty=0.8, frequency_penalty=2.0),
            [6],
            [6, 6],
        ),
    ]
    for seq in seqs:
        if seq.params.needs_logits_processing:
            processing.register(seq)
    batch = SimpleNamespace(seqs=seqs, samples=lambda i: True)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    expected = [_reference(logits[j], s) for j, s in enumerate(seqs)]
    out = processing.for_batch(batch).apply(logits.clone())
    for j in range(4):
        torch.testing.assert_close(out[j].double(), expected[j], rtol=1e-6, atol=1e-5)


def test_penalties_follow_the_tokens_each_step_appends():
    """The per-sequence histories are incremental: after tokens are appended (repeats, new ones,
    several in one step as speculation appends them) each step still equals the reference."""
    vocab = 41
    processing = LogitsProcessing(vocab, tokenizer=None, eos_token_ids=[1])
    seqs = [
        _seq(SamplingParams(repetition_penalty=1.7, presence_penalty=0.3), [2, 2, 40], []),
        _seq(SamplingParams(frequency_penalty=0.9, logit_bias={3: 2.0}), [5], [5]),
        _seq(
            SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.5), [7, 8], [8]
        ),
    ]
    for seq in seqs:
        processing.register(seq)
    batch = SimpleNamespace(seqs=seqs, samples=lambda i: True)
    generator = torch.Generator().manual_seed(1)
    appended = [[[40], [], [7, 7]], [[2, 40], [5, 5, 0], [9]], [[11], [3], [8, 8, 8]]]
    for step in appended:
        for seq, tokens in zip(seqs, step, strict=True):
            for token in tokens:
                seq.append_token(token)
        logits = torch.randn(3, vocab, generator=generator) * 4
        expected = [_reference(logits[j], s) for j, s in enumerate(seqs)]
        out = processing.for_batch(batch).apply(logits.clone())
        for j in range(3):
            torch.testing.assert_close(out[j].double(), expected[j], rtol=1e-6, atol=1e-5)


def test_a_batch_of_plain_requests_needs_no_processing():
    processing = LogitsProcessing(37, tokenizer=None, eos_token_ids=[1])
    batch = SimpleNamespace(
        seqs=[_seq(SamplingParams(temperature=0.5, top_k=3), [1], [2])], samples=lambda i: True
    )
    assert processing.for_batch(batch) is None


@pytest.mark.gpu
def test_grammar_and_logprobs_on_cuda_graph_steps():
    """On CUDA, decode steps replay graphs: processed rows still get their logits (not the graph's
    argmax), the mask is applied on the device, and a greedy json_schema answer validates."""
    import json

    from tpfuse.engine.sampling_params import Grammar

    engine = LLMEngine(EngineConfig(model="tiny", device="cuda", max_model_len=512))
    try:
        schema = {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
                "s": {"type": "string", "maxLength": 6},
            },
            "required": ["n", "s"],
            "additionalProperties": False,
        }
        params = SamplingParams(
            temperature=0, max_tokens=64, logprobs=2, grammar=Grammar("json_schema", json.dumps(schema))
        )
        engine.add_request("g", engine.tokenizer.encode("JSON:"), params)
        engine.add_request(
            "plain", engine.tokenizer.encode("plain"), SamplingParams(temperature=0, max_tokens=16)
        )
        tokens, entries = [], []
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id == "g":
                    tokens += output.new_token_ids
                    entries += output.logprobs
        value = json.loads(engine.tokenizer.decode(tokens))
        assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and len(value["s"]) <= 6
        assert len(entries) == len(tokens) and all(
            e.token_id == t for e, t in zip(entries, tokens, strict=True)
        )
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "extra", [{"ignore_eos": True}, {"min_tokens": 10}], ids=["ignore_eos", "min_tokens"]
)
def test_a_complete_grammar_answer_keeps_sampling_end_ids_instead_of_raising(engine, extra):
    """Once the matcher has accepted its stop token, xgrammar fills no mask; a request that must go on
    (ignore_eos, min_tokens) then samples end-of-sequence ids only, and the engine keeps serving."""
    import json

    from tpfuse.engine.sampling_params import Grammar

    grammar = Grammar("json_schema", json.dumps({"type": "boolean"}))
    params = SamplingParams(temperature=0, max_tokens=12, grammar=grammar, **extra)
    engine.add_request("done-early", engine.tokenizer.encode("bool:"), params)
    plain = SamplingParams(temperature=0, max_tokens=12)
    engine.add_request("plain", engine.tokenizer.encode("plain"), plain)
    tokens: dict[str, list[int]] = {"done-early": [], "plain": []}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    ends = set(engine.logits_processing.eos_token_ids)
    answer = tokens["done-early"]
    first_end = next(i for i, t in enumerate(answer) if t in ends)
    assert json.loads(engine.tokenizer.decode(answer[:first_end])) in (True, False)
    assert set(answer[first_end:]) <= ends and len(answer) >= 10
    assert len(tokens["plain"]) == 12


def test_a_byte_tokenizer_grammar_covers_its_own_ids_and_masks_the_models_padding():
    """The byte tokenizer's grammars are compiled over its bytes and specials only (xgrammar's fill
    time grows with the width); ids past them, which preset models have, are never allowed."""
    import json

    from tpfuse.engine.sampling_params import Grammar
    from tpfuse.model.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    vocab = tokenizer.vocab_size + 300
    processing = LogitsProcessing(vocab, tokenizer, sorted(tokenizer.eos_token_ids))
    assert processing.grammar_vocab_size == tokenizer.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=8, grammar=Grammar("json_schema", json.dumps({"type": "integer"}))
    )
    seq = _seq(params, [65], [])
    processing.register(seq)
    logits = torch.zeros(1, vocab)
    out = processing.for_batch(SimpleNamespace(seqs=[seq], samples=lambda i: True)).apply(logits)
    allowed = (out[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and set(allowed) <= {ord(c) for c in "-0123456789"}
    assert torch.all(out[0, tokenizer.vocab_size :] == float("-inf"))


def _allowed_after(processing, grammar, output: list[int]) -> set[int]:
    seq = _seq(SamplingParams(temperature=0, max_tokens=16, grammar=grammar), [65], list(output))
    processing.register(seq)
    logits = torch.zeros(1, processing.vocab_size)
    out = processing.for_batch(SimpleNamespace(seqs=[seq], samples=lambda i: True)).apply(logits)
    return set((out[0] > float("-inf")).nonzero().flatten().tolist())


def test_a_byte_level_string_never_continues_into_a_utf16_surrogate():
    """xgrammar lets 0xED go on with 0xA0..0xBF (a surrogate's UTF-8 form, which is not UTF-8 and
    decodes to three U+FFFD): the mask forbids them there, and only there."""
    import json

    from tpfuse.engine.sampling_params import Grammar
    from tpfuse.model.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    processing = LogitsProcessing(tokenizer.vocab_size, tokenizer, sorted(tokenizer.eos_token_ids))
    grammar = Grammar("json_schema", json.dumps({"type": "string", "maxLength": 10}))
    after_lead = _allowed_after(processing, grammar, [ord('"'), 0xED])
    assert after_lead and after_lead <= set(range(0x80, 0xA0))  # U+D000..U+D7FF only
    after_e1 = _allowed_after(processing, grammar, [ord('"'), 0xE1])
    assert set(range(0x80, 0xC0)) <= after_e1  # other leads keep their whole continuation range


def test_a_grammar_no_token_can_continue_ends_the_answer():
    """An unsatisfiable schema (no string matches [^\\s\\S]) leaves no token after the quote: the row
    may then only end, as a complete one does, instead of sampling from all -inf (token 0)."""
    import json

    from tpfuse.engine.sampling_params import Grammar
    from tpfuse.model.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    processing = LogitsProcessing(tokenizer.vocab_size, tokenizer, sorted(tokenizer.eos_token_ids))
    grammar = Grammar("json_schema", json.dumps({"type": "string", "pattern": "[^\\s\\S]"}))
    assert _allowed_after(processing, grammar, [ord('"')]) == set(tokenizer.eos_token_ids)
