"""The DeepSeek-V3 MTP (NextN) drafter on a tiny random DeepseekV3ForCausalLM written by transformers, with
MTP tensors (model.layers.3.*: enorm, hnorm, eh_proj, a MoE decoder layer, shared_head, embed_tokens)
added at random: the module's logits equal a float64 reference of the formula (transformers' decoder
layer under it), speculative greedy equals plain greedy with and without adaptive k while drafts are
proposed, and a checkpoint without MTP tensors is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.engine.checkpoints import save_byte_tokenizer
from tests.model.test_deepseek_v3 import build_deepseek_checkpoint
from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.config import EngineConfig, SpeculativeConfig
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.model.layers import ParallelContext
from tpfuse.model.loader import CheckpointError, load_model
from tpfuse.spec.paged import metadata_for_positions

KIND = "q_lora_yarn_tied_groups"
PROMPTS = [[5, 250, 17, 3, 99, 42, 7, 7, 100, 31], [1, 2, 200]]
NEAR_TIE = 5e-4  # a float32 draft may differ from the float64 argmax only where its top two logits tie
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)


def add_mtp_layer(directory: str, seed: int = 1) -> None:
    """Appends a random MTP layer (index num_hidden_layers, a copy of the last layer's tensors plus noise,
    and its own norms, eh_proj, head and embedding) in one more shard, listed in the index."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(directory, file)))
    gen = torch.Generator().manual_seed(seed)
    noise = lambda t, s: t + torch.randn(t.shape, generator=gen) * s  # noqa: E731
    last, prefix = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {prefix + k[len(last) :]: noise(v, 0.02) for k, v in tensors.items() if k.startswith(last)}
    mtp[prefix + "enorm.weight"] = noise(torch.ones(hidden), 0.1)
    mtp[prefix + "hnorm.weight"] = noise(torch.ones(hidden), 0.1)
    mtp[prefix + "shared_head.norm.weight"] = noise(torch.ones(hidden), 0.1)
    mtp[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
    mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[prefix + "shared_head.head.weight"] = noise(tensors["lm_head.weight"], 0.01)
    save_file({k: v.contiguous() for k, v in mtp.items()}, os.path.join(directory, "model-mtp.safetensors"))
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str, object]:
    """(with MTP, without MTP, the transformers target model)."""
    plain = str(tmp_path_factory.mktemp("deepseek_plain"))
    hf_model = build_deepseek_checkpoint(plain, KIND)
    save_byte_tokenizer(plain)
    with_mtp = str(tmp_path_factory.mktemp("deepseek_mtp")) + "/ckpt"
    shutil.copytree(plain, with_mtp)
    add_mtp_layer(with_mtp)
    return with_mtp, plain, hf_model


class MtpReference:
    """float64 MTP of the formula (h: the target's final hidden states after its norm, from float32, an
    input as served): the entry at t reads h_t and token t + 1, x = eh_proj([enorm(E[tok]); hnorm(h)]),
    then transformers' decoder layer (in a 1-layer model whose norm and lm_head are shared_head's) gives
    the logits for token t + 2; a chained entry reads the previous entry's normed output."""

    def __init__(self, directory: str, hf_target, scratch: str):
        import transformers
        from safetensors.torch import load_file, save_file

        w = {k: v.double() for k, v in load_file(os.path.join(directory, "model-mtp.safetensors")).items()}
        prefix = f"model.layers.{hf_target.config.num_hidden_layers}."
        self.w = w = {k[len(prefix) :]: v for k, v in w.items()}
        self.target, self.eps = hf_target, hf_target.config.rms_norm_eps
        config = transformers.DeepseekV3Config(**{**hf_target.config.to_dict(), "num_hidden_layers": 1})
        config.first_k_dense_replace = 0  # the MTP layer is a MoE layer
        own = ("enorm.", "hnorm.", "eh_proj.")
        renamed = {
            "shared_head.norm.weight": "model.norm.weight",
            "shared_head.head.weight": "lm_head.weight",
            "embed_tokens.weight": "model.embed_tokens.weight",
        }
        state = {renamed.get(k, "model.layers.0." + k): v for k, v in w.items() if not k.startswith(own)}
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(scratch, "model.safetensors"))
        config.save_pretrained(scratch)
        self.one = transformers.AutoModelForCausalLM.from_pretrained(
            scratch, dtype=torch.float64, experts_implementation="eager"
        ).eval()

    def _entry(self, token_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        rms = lambda x, g: g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # noqa: E731
        e = self.w["embed_tokens.weight"][token_ids]
        return torch.cat([rms(e, self.w["enorm.weight"]), rms(h, self.w["hnorm.weight"])], -1) @ (
            self.w["eh_proj.weight"].T
        )

    @torch.no_grad()
    def run(self, tokens: list[int], num_chained: int = 0, forced: list[int] | None = None):
        """(logits [T - 1, V] of the entries 0..T-2 over tokens, num_chained + 1 argmax drafts for the
        position after tokens (draft i + 1 from the entry after draft i), and each draft's top-2 logit
        gap). forced: the drafts to chain on instead of the argmax ones."""
        ids = torch.tensor([tokens])
        h = self.target.model(input_ids=ids).last_hidden_state[0, :-1].double()
        x = self._entry(ids[0, 1:], h)
        drafts, gaps = [], []
        for i in range(num_chained + 1):
            out = self.one.model(inputs_embeds=x[None], position_ids=torch.arange(1, len(x) + 1)[None])
            normed = out.last_hidden_state[0]
            logits = self.one.lm_head(normed)
            top = logits[-1].topk(2).values
            drafts.append(int(logits[-1].argmax()))
            gaps.append(float(top[0] - top[1]))
            if i == 0:
                first = logits
            chained = drafts[-1] if forced is None else forced[i]
            x = torch.cat([x, self._entry(torch.tensor([chained]), normed[-1:])])
        return first, drafts, gaps


def test_mtp_module_matches_a_float64_reference(checkpoints, tmp_path):
    from tpfuse.model.deepseek_v3_mtp import load_mtp_module
    from tpfuse.spec.mtp import MtpHead

    directory, _, hf_target = checkpoints
    engine_config = EngineConfig(model=directory, dtype="float32")
    parallel = ParallelContext(0, 1, SingleRankCommunicator())
    target, config = load_model(engine_config, parallel, "cpu")
    head = MtpHead(load_mtp_module(engine_config, target, config, parallel, "cpu"), target.cos_sin_cache, 253)
    tokens = PROMPTS[0]
    want = MtpReference(directory, hf_target, str(tmp_path)).run(tokens)[0]
    with torch.no_grad():
        target_h = hf_target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0, :-1]
        num = len(tokens) - 1
        cache = torch.full(head.kv_cache_shape(8, 4), float("nan"))
        tables = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)
        positions = torch.arange(num)  # the reference's are 1..num: rope is relative, the outputs agree
        attn = metadata_for_positions(tables, 4, positions, torch.tensor([0, num], dtype=torch.int32))
        embeds = head.module.embed(torch.tensor(tokens[1:]))
        normed, fed_back = head(embeds, head.combine_features(target_h), positions, attn, (cache,))
        got = head.compute_logits(normed)
    assert fed_back is normed
    error = (got.double() - want).norm() / want.norm()
    assert error <= 1e-4, error


def _generate(directory: str, speculative: SpeculativeConfig | None) -> tuple[list[list[int]], object]:
    llm = LLM(directory, **ENGINE, **({"speculative": speculative} if speculative else {}))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm.engine.stats()


@pytest.fixture(scope="module")
def plain_tokens(checkpoints) -> list[list[int]]:
    return _generate(checkpoints[0], None)[0]


def test_checkpoint_without_mtp_layer_is_refused_by_name(checkpoints):
    plain = checkpoints[1]
    with pytest.raises(CheckpointError, match="has no MTP \\(NextN\\) layer"):
        LLM(plain, **ENGINE, speculative=SpeculativeConfig(algorithm="mtp"))


def _check_chains(records, sequences, reference: MtpReference) -> int:
    """Asserts every recorded proposal row equals the reference chain (each draft the argmax of the
    reference entry chained on the row's own drafts, up to near ties); returns how many were checked."""
    checked = 0
    for positions, next_ids, drafts in records:
        for p, nxt, row in zip(positions, next_ids, drafts, strict=True):
            matches = [seq for seq in sequences if len(seq) > p + 1 and seq[p + 1] == nxt]
            if len(matches) != 1:
                continue  # this row's sequence is ambiguous from (position, token)
            _, want, gaps = reference.run(matches[0][: p + 2], len(row) - 1, forced=row)
            for got, draft, gap in zip(row, want, gaps, strict=True):
                assert got == draft or gap < NEAR_TIE, (p, row, want, gaps)
            checked += 1
    return checked


def _record_proposals(monkeypatch) -> list:
    """Records (newest positions, newest tokens, drafts) of every drafting propose in this process."""
    from tpfuse.spec.mtp import MtpDrafter

    records = []
    propose = MtpDrafter.propose

    def recording(self, inputs, num_draft_tokens):
        proposal = propose(self, inputs, num_draft_tokens)
        if num_draft_tokens:
            last = inputs.last_index()
            records.append((inputs.positions[last].tolist(), inputs.next_token_ids[last].tolist(),
                            proposal.token_ids.tolist()))  # fmt: skip
        return proposal

    monkeypatch.setattr(MtpDrafter, "propose", recording)
    return records


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_mtp_is_lossless_and_every_draft_chain_equals_the_reference_chain(
    checkpoints, plain_tokens, tmp_path, monkeypatch, adaptive
):
    """Speculative greedy equals plain greedy, and each proposal the engine's drafter makes (after
    prefill chunks, plain k = 0 steps, catch-up over accepted or rejected positions) equals the float64
    chain over the sequence's tokens so far: the features, the MTP cache and the chained feedback are
    the formula's."""
    directory, _, hf_target = checkpoints
    records = _record_proposals(monkeypatch)
    spec = SpeculativeConfig(algorithm="mtp", num_steps=2, adaptive=adaptive)
    outputs, stats = _generate(directory, spec)
    assert outputs == plain_tokens
    assert stats.spec_num_draft_tokens_total > 0
    sequences = [prompt + out for prompt, out in zip(PROMPTS, outputs, strict=True)]
    assert _check_chains(records, sequences, MtpReference(directory, hf_target, str(tmp_path))) >= 6


def test_tp2_mtp_is_lossless_and_rank0_chains_equal_the_reference(
    checkpoints, plain_tokens, tmp_path, monkeypatch
):
    """TP 2 over gloo: the MTP layer sharded like the target (heads, experts' intermediate dim, the
    vocabulary of its embedding and head; eh_proj replicated) drafts the reference's chains on rank 0,
    and the tokens equal TP 1 plain greedy."""
    directory, _, hf_target = checkpoints
    records = _record_proposals(monkeypatch)
    llm = LLM(directory, **ENGINE, tp_size=2, speculative=SpeculativeConfig(algorithm="mtp", num_steps=2))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outputs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.shutdown()
    assert outputs == plain_tokens
    sequences = [prompt + out for prompt, out in zip(PROMPTS, outputs, strict=True)]
    assert _check_chains(records, sequences, MtpReference(directory, hf_target, str(tmp_path))) >= 4


def test_dummy_weights_build_an_mtp_layer_for_benchmarks(checkpoints):
    """--load-format dummy (and presets) get a seeded random MTP layer with its own embedding and head."""
    from tpfuse.model.deepseek_v3_mtp import load_mtp_module

    engine_config = EngineConfig(model=checkpoints[1], dtype="float32", load_format="dummy")
    parallel = ParallelContext(0, 1, SingleRankCommunicator())
    target, config = load_model(engine_config, parallel, "cpu")
    module = load_mtp_module(engine_config, target, config, parallel, "cpu")
    assert module.own_embedding and module.own_head and module.layer_index == config.num_layers
    assert type(module.layer.mlp).__name__ == "DeepseekV3MoE"
    assert all(bool(torch.isfinite(p).all()) and p.abs().sum() > 0 for p in module.parameters())
