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


def _reference_logits(directory: str, hf_target, tokens: list[int], scratch: str) -> torch.Tensor:
    """float64 (h: the target's final hidden states after its norm at positions 0..T-2, from float32):
    the MTP entry at t reads h_t and token t + 1: x = eh_proj([enorm(E[tok]); hnorm(h)]), then
    transformers' decoder layer (in a 1-layer model whose norm and lm_head are shared_head's) gives the
    logits for token t + 2."""
    import transformers
    from safetensors.torch import load_file, save_file

    w = {k: v.double() for k, v in load_file(os.path.join(directory, "model-mtp.safetensors")).items()}
    prefix = f"model.layers.{hf_target.config.num_hidden_layers}."
    w = {k[len(prefix) :]: v for k, v in w.items()}
    target = hf_target
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = target.model(input_ids=ids).last_hidden_state[0, :-1].double()  # an input: float32 as served
        eps = target.config.rms_norm_eps
        rms = lambda x, g: g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
        e = w["embed_tokens.weight"][ids[0, 1:]]
        x = torch.cat([rms(e, w["enorm.weight"]), rms(h, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        config = transformers.DeepseekV3Config(**{**target.config.to_dict(), "num_hidden_layers": 1})
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
        one = transformers.AutoModelForCausalLM.from_pretrained(
            scratch, dtype=torch.float64, experts_implementation="eager"
        ).eval()
        out = one(inputs_embeds=x[None], position_ids=torch.arange(1, len(tokens))[None]).logits[0]
    return out


def test_mtp_module_matches_a_float64_reference(checkpoints, tmp_path):
    from tpfuse.model.deepseek_v3_mtp import load_mtp_module
    from tpfuse.spec.mtp import MtpHead

    directory, _, hf_target = checkpoints
    engine_config = EngineConfig(model=directory, dtype="float32")
    parallel = ParallelContext(0, 1, SingleRankCommunicator())
    target, config = load_model(engine_config, parallel, "cpu")
    head = MtpHead(load_mtp_module(engine_config, target, config, parallel, "cpu"), target.cos_sin_cache, 253)
    tokens = PROMPTS[0]
    want = _reference_logits(directory, hf_target, tokens, str(tmp_path))
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


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_mtp_speculative_greedy_equals_plain_greedy(checkpoints, plain_tokens, adaptive):
    directory, want = checkpoints[0], plain_tokens
    got, stats = _generate(directory, SpeculativeConfig(algorithm="mtp", num_steps=2, adaptive=adaptive))
    assert got == want
    assert stats.spec_num_draft_tokens_total > 0


def test_checkpoint_without_mtp_layer_is_refused_by_name(checkpoints):
    plain = checkpoints[1]
    with pytest.raises(CheckpointError, match="has no MTP \\(NextN\\) layer"):
        LLM(plain, **ENGINE, speculative=SpeculativeConfig(algorithm="mtp"))
