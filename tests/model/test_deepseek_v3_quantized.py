"""DeepseekV3ForCausalLM in its quantized public layouts, written by the test from a random transformers
checkpoint: DeepSeek-V3's FP8 (quant_method fp8, 128x128 weight_block_size: every linear e4m3 with a
float32 weight_scale_inv per block, kv_b_proj and the routed and shared experts included) and Kimi K2's
compressed-tensors INT4 group-32 routed experts (pack-quantized; attention, shared experts and the dense
MLP left unquantized by the ignore list). tpfuse's float32 greedy tokens equal transformers' on the same
weights dequantized, at TP 1 and 2; the presets build with --quantization fp8-block at their real
shapes; bad checkpoints fail at load naming the tensor or field."""

from __future__ import annotations

import functools
import json
import logging
import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.model import quant_checkpoints as qc
from tests.model.harness import (
    greedy,
    greedy_on_rank,
    hf_greedy_tokens,
    hf_logits,
    load_for_test,
    relative_error,
)
from tests.model.test_deepseek_v3 import build_deepseek_checkpoint
from tpfuse.model.linear_method import UNQUANTIZED
from tpfuse.model.loader import CheckpointError
from tpfuse.model.quant import QuantizationError
from tpfuse.model.quant.experts import Fp8Experts, IntGroupExperts
from tpfuse.model.quant.fp8 import Fp8LinearMethod

PROMPTS = [[5, 250, 17, 3, 99, 42, 7, 7, 100, 31], [1, 2, 200]]
NEW_TOKENS = 6
TOLERANCE = 1e-4
# Several 128-blocks per tensor, partial ones (kv_a: 176 rows, kv_lora_rank 160), kv_b_proj's heads
# (96 rows each) off the block rows, and TP 2 shards that split row-parallel inputs on whole blocks.
SHAPE = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=256, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=96, kv_lora_rank=160, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=64,
)  # fmt: skip
LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
           "gate_proj", "up_proj", "down_proj", "eh_proj")  # fmt: skip
DEEPSEEK_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]


def _is_linear(name: str) -> bool:
    module, _, last = name.rpartition(".")
    return last == "weight" and module.rsplit(".", 1)[-1] in LINEARS


def _kimi_config() -> dict:
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    return {**qc.compressed_tensors_config(weights, "pack-quantized"), "ignore": KIMI_IGNORE}


FORMATS = {
    # every linear (attention, kv_b_proj, dense MLP, shared and routed experts) in 128x128 FP8 blocks
    "deepseek-fp8-block": (_is_linear, qc.fp8_block, DEEPSEEK_FP8),
    # only the routed experts INT4 group 32; the rest float, as the ignore list says
    "kimi-int4-experts": (
        lambda name: _is_linear(name) and ".mlp.experts." in name,
        functools.partial(qc.int_pack_quantized, bits=4, group=32),
        _kimi_config(),
    ),
}


def write_quantized_deepseek(directory, fmt: str, with_mtp: bool = False, **overrides):
    """A random DeepseekV3ForCausalLM (with_mtp: and an MTP layer, model.layers.3.*) whose selected
    linears are rewritten into fmt's on-disk tensors (one model.safetensors); returns transformers' model
    of the dequantized weights, loaded from a float copy with the on-disk names (directory/dequantized,
    so transformers maps the per-expert tensors itself; tpfuse loads it too). overrides: config fields."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    selected, quantizer, quantization_config = FORMATS[fmt]
    build_deepseek_checkpoint(directory, "q_lora_yarn_tied_groups", tie_groups=False, **SHAPE, **overrides)
    if with_mtp:
        from tests.spec.test_mtp import add_mtp_layer

        add_mtp_layer(str(directory))
    state = {}
    for file in [f for f in os.listdir(directory) if f.endswith(".safetensors")]:
        state.update(load_file(os.path.join(directory, file)))
        os.remove(os.path.join(directory, file))
    os.remove(os.path.join(directory, "model.safetensors.index.json"))
    stored, dequantized = {}, {}
    for name, tensor in state.items():
        if selected(name):
            tensors, dequantized[name] = quantizer(tensor.float())
            prefix = name.removesuffix(".weight")
            stored.update({f"{prefix}.{suffix}": t for suffix, t in tensors.items()})
        else:
            stored[name] = dequantized[name] = tensor
    save_file(stored, os.path.join(directory, "model.safetensors"))
    reference = os.path.join(directory, "dequantized")
    os.makedirs(reference)
    save_file(dequantized, os.path.join(reference, "model.safetensors"))
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(os.path.join(reference, "config.json"), "w") as f:
        json.dump(config, f)
    with open(config_path, "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f)
    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]], torch.Tensor]]:
    """fmt -> (directory, transformers' greedy tokens, transformers' prompt logits)."""
    found = {}
    for fmt in FORMATS:
        directory = tmp_path_factory.mktemp(fmt)
        hf_model = write_quantized_deepseek(directory, fmt)
        logits = torch.cat(hf_logits(hf_model, PROMPTS))
        found[fmt] = (str(directory), hf_greedy_tokens(hf_model, PROMPTS, NEW_TOKENS), logits)
    return found


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(checkpoints, fmt, caplog):
    directory, want_tokens, want_logits = checkpoints[fmt]
    with caplog.at_level(logging.INFO, logger="tpfuse"):
        model, _ = load_for_test(directory)
    tokens, prefill = greedy(model, PROMPTS, NEW_TOKENS)
    assert relative_error(prefill, want_logits) <= TOLERANCE
    assert tokens == want_tokens
    attn, dense, moe = model.layers[1].self_attn, model.layers[0].mlp, model.layers[1].mlp
    assert attn.kv_b_proj.weight.dtype == torch.float32  # the run dtype: read by the absorbed bmm
    shared = moe.shared_experts
    linears = (attn.fused_a_proj, attn.q_b_proj, attn.o_proj, dense.gate_up_proj, shared.down_proj)
    if fmt == "deepseek-fp8-block":
        for linear in linears:
            assert isinstance(linear.method, Fp8LinearMethod) and linear.weight.dtype == torch.float8_e4m3fn
        assert isinstance(moe.experts.method, Fp8Experts) and moe.experts.w13.dtype == torch.float8_e4m3fn
        assert "fp8-block 128x128 dequantized at load (MLA's absorbed W_UK / W_UV) x3" in caplog.text
    else:
        for linear in linears:
            assert linear.method is UNQUANTIZED
        assert isinstance(moe.experts.method, IntGroupExperts) and moe.experts.method.group == 32
        assert "int4 group 32 experts x2" in caplog.text


def test_two_ranks_give_transformers_greedy_tokens(checkpoints):
    directories = {fmt: entry[0] for fmt, entry in checkpoints.items()}
    ranks = run_distributed(greedy_on_rank, 2, directories, PROMPTS, NEW_TOKENS, timeout=300)
    for fmt, (_, want_tokens, want_logits) in checkpoints.items():
        for rank in ranks:
            tokens, prefill = rank[fmt]
            assert tokens == want_tokens, fmt
            assert relative_error(torch.from_numpy(prefill), want_logits) <= TOLERANCE, fmt


def _copy_with(source: str, destination, drop: str | None = None, ignore: list[str] | None = None):
    from safetensors.torch import load_file, save_file

    os.makedirs(destination, exist_ok=True)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    save_file(tensors, os.path.join(destination, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    if ignore is not None:
        config["quantization_config"]["ignore"] = ignore
    with open(os.path.join(destination, "config.json"), "w") as f:
        json.dump(config, f)
    return destination


def test_a_missing_kv_b_proj_scale_names_the_tensor(checkpoints, tmp_path):
    missing = "model.layers.2.self_attn.kv_b_proj.weight_scale_inv"
    bad = _copy_with(checkpoints["deepseek-fp8-block"][0], tmp_path, drop=missing)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\) .*" + missing.replace(".", r"\.")):
        load_for_test(bad)


def test_an_ignore_list_that_splits_the_fused_a_projection_names_both_modules(checkpoints, tmp_path):
    bad = _copy_with(
        checkpoints["kimi-int4-experts"][0], tmp_path, ignore=["lm_head", "re:.*kv_a_proj_with_mqa"]
    )
    with pytest.raises(
        QuantizationError,
        match=r"ignore leaves model\.layers\.0\.self_attn\.kv_a_proj_with_mqa unquantized but not "
        r"model\.layers\.0\.self_attn\.q_a_proj",
    ):
        load_for_test(bad)


@pytest.mark.parametrize("quantization", ["fp8-block", "int4-experts"])
def test_dummy_quantized_weights_build_and_run(checkpoints, quantization):
    directory = checkpoints["kimi-int4-experts"][0]
    model, _ = load_for_test(directory, load_format="dummy", quantization=quantization)
    experts, o_proj = model.layers[1].mlp.experts, model.layers[1].self_attn.o_proj
    if quantization == "fp8-block":
        assert isinstance(experts.method, Fp8Experts) and isinstance(o_proj.method, Fp8LinearMethod)
    else:
        assert isinstance(experts.method, IntGroupExperts) and experts.method.group == 32
        assert o_proj.method is UNQUANTIZED
    tokens, prefill = greedy(model, PROMPTS, 2)
    assert torch.isfinite(prefill).all() and len(tokens[0]) == 2


def _preset_quantization(name: str):
    from tpfuse.model import quant

    if name == "fp8-block":  # --load-format dummy --quantization fp8-block
        return quant.for_dummy("fp8-block")
    return quant.from_hf_config({"quantization_config": _kimi_config()})  # Kimi K2-Thinking's layout


@pytest.mark.parametrize(
    "preset,quantization",
    [("deepseek-v3-4l", "fp8-block"), ("kimi-k2-3l", "fp8-block"), ("kimi-k2-3l", "kimi-int4-experts")],
)
@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (7, 8)])
def test_presets_build_quantized_at_their_real_shapes(preset, quantization, tp_rank, tp_size):
    """On the meta device: every 128x128 FP8 scale block, INT4 group and shard boundary of the real
    shapes fits, and every parameter is some checkpoint tensor's destination."""
    from tpfuse.comm.communicator import SingleRankCommunicator
    from tpfuse.model.layers import ParallelContext
    from tpfuse.model.linear_method import linear_methods
    from tpfuse.model.loader import check_all_parameters_written
    from tpfuse.model.presets import preset_config
    from tpfuse.model.registry import model_class

    config = preset_config(preset, "bfloat16")
    parallel = ParallelContext(tp_rank, tp_size, SingleRankCommunicator())
    with torch.device("meta"), linear_methods(_preset_quantization(quantization)):
        model = model_class(config.architecture)(config, parallel)
    slots = model.checkpoint_slots()
    check_all_parameters_written(model, slots)
    last = f"model.layers.{config.num_layers - 1}."
    experts = model.layers[-1].mlp.experts
    expert_weights = 3 * config.num_experts * config.moe_intermediate_size * config.hidden_size // tp_size
    if quantization == "fp8-block":
        assert last + "mlp.experts.0.down_proj.weight_scale_inv" in slots
        assert last + "self_attn.kv_b_proj.weight_scale_inv" in slots
        codes = sum(p.numel() for p in experts.parameters() if p.dtype == torch.float8_e4m3fn)
    else:
        assert last + "mlp.experts.0.down_proj.weight_packed" in slots
        assert last + "self_attn.kv_b_proj.weight" in slots  # bf16: the ignore list's
        assert last + "mlp.shared_experts.up_proj.weight" in slots
        codes = 8 * (experts.w13_packed.numel() + experts.w2_packed.numel())
    assert codes == expert_weights


def test_the_mtp_layer_of_an_fp8_checkpoint_equals_its_dequantized_twin(tmp_path):
    """The MTP layer (eh_proj, MLA, the FP8 experts) takes the checkpoint's methods like the target's
    layers: its logits equal those of the same layer loaded from the dequantized float weights (whose
    formula tests/spec/test_mtp.py checks against float64)."""
    from tpfuse.comm.communicator import SingleRankCommunicator
    from tpfuse.config import EngineConfig
    from tpfuse.model.deepseek_v3_mtp import load_mtp_module
    from tpfuse.model.layers import ParallelContext
    from tpfuse.model.loader import load_model
    from tpfuse.spec.mtp import MtpHead
    from tpfuse.spec.paged import metadata_for_positions

    write_quantized_deepseek(tmp_path, "deepseek-fp8-block", with_mtp=True)
    parallel = ParallelContext(0, 1, SingleRankCommunicator())
    tokens, logits = PROMPTS[0], {}
    for name, directory in (("fp8", tmp_path), ("float", tmp_path / "dequantized")):
        engine_config = EngineConfig(model=str(directory), dtype="float32")
        target, config = load_model(engine_config, parallel, "cpu")
        module = load_mtp_module(engine_config, target, config, parallel, "cpu")
        head = MtpHead(module, target.cos_sin_cache, config.vocab_size)
        if name == "fp8":
            assert isinstance(module.eh_proj.method, Fp8LinearMethod)
            assert isinstance(module.layer.mlp.experts.method, Fp8Experts)
            assert module.layer.self_attn.kv_b_proj.weight.dtype == torch.float32
        with torch.no_grad():
            hidden, _ = greedy_hidden(target, tokens)
            num = len(tokens) - 1
            cache = torch.full(head.kv_cache_shape(8, 4), float("nan"))
            tables = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)
            positions = torch.arange(num)
            attn = metadata_for_positions(tables, 4, positions, torch.tensor([0, num], dtype=torch.int32))
            normed, _ = head(module.embed(torch.tensor(tokens[1:])), hidden[:-1], positions, attn, (cache,))
            logits[name] = head.compute_logits(normed)
    assert relative_error(logits["fp8"], logits["float"]) <= TOLERANCE


def greedy_hidden(model, tokens: list[int]):
    """The target's final hidden states [T, H] (after its norm) over one prompt, from a fresh cache."""
    from tests.model.harness import PagedSequences

    seqs = PagedSequences(model, 1)
    attn, positions = seqs.metadata([len(tokens)], is_decode=False)
    return model(torch.tensor(tokens), positions, attn, seqs.kv_caches)


def test_a_family_that_does_not_name_its_linears_refuses_a_wider_ignore_list():
    """Outside a module_prefix (families other than DeepSeek-V3) a linear has no checkpoint name, so
    an ignore list naming more than lm_head and routers is refused, naming the field."""
    from tpfuse.model import quant
    from tpfuse.model.linear_method import linear_methods, method_for

    config = quant.from_hf_config({"quantization_config": _kimi_config()})
    with linear_methods(config), pytest.raises(QuantizationError, match=r"ignore leaves re:\.\*self_attn"):
        method_for("column", ["gate_proj", "up_proj"])
