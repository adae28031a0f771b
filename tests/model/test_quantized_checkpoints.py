"""Quantized checkpoints in their public layouts (FP8 per-tensor/per-channel/block, compressed-tensors
INT4/INT8 pack-quantized, GPTQ): tpfuse's greedy tokens (float32, CPU) equal transformers' on the
same weights dequantized; bad checkpoints and unsupported formats fail at load, naming the culprit."""

from __future__ import annotations

import functools
import json
import os
import random

import pytest
import torch

from tests.engine.checkpoints import hf_greedy
from tests.model import quant_checkpoints as qc
from tests.model.harness import load_for_test
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.model.loader import CheckpointError
from tpfuse.model.quant import QuantizationError

NEW_TOKENS = 8
FP8_BLOCK = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
BLOCK_SHAPE = dict(hidden_size=256, intermediate_size=384, head_dim=64)  # several 128-blocks per tensor
GROUP_128_SHAPE = dict(hidden_size=128, intermediate_size=256)


def _int4_group(kind: str, group: int, shape: dict) -> tuple:
    """A FORMATS entry: compressed-tensors INT4 pack-quantized, symmetric, `group` columns per scale."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group, "symmetric": True}
    quantizer = functools.partial(qc.int_pack_quantized, bits=4, group=group)
    return kind, quantizer, qc.compressed_tensors_config(weights, "pack-quantized"), shape


FORMATS = {
    "fp8-channel": (
        "llama",
        qc.fp8_channel,
        qc.compressed_tensors_config(
            {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "float-quantized",
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True},
        ),
        {},
    ),
    "fp8-tensor-static-input": (
        "qwen2",
        qc.fp8_tensor,
        qc.compressed_tensors_config(
            {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
            "float-quantized",
            {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
        ),
        {},
    ),
    "fp8-block": ("qwen3", qc.fp8_block, FP8_BLOCK, BLOCK_SHAPE),
    "int4-group32": _int4_group("llama", 32, {}),
    "int4-group128": _int4_group("qwen3", 128, GROUP_128_SHAPE),
    # dense layers and every expert pack-quantized
    "int4-group32-qwen3-moe": _int4_group("qwen3_moe", 32, {}),
    "fp8-block-qwen3-moe": (  # dense layers and every expert in 128x128-block FP8
        "qwen3_moe",
        qc.fp8_block,
        FP8_BLOCK,
        {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 384},
    ),
    "fp8-channel-qwen3-moe": (
        "qwen3_moe",
        qc.fp8_channel,
        qc.compressed_tensors_config(
            {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}, "float-quantized"
        ),
        {},
    ),
    "gptq-4bit-group32": (
        "mistral",
        functools.partial(qc.gptq_asymmetric, bits=4, group=32),
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
        {},
    ),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quantized(request, tmp_path_factory):
    kind, quantizer, config, shape = FORMATS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = qc.write_quantized(directory, kind, quantizer, config, **shape)
    return directory, hf_model


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(quantized):
    directory, hf_model = quantized
    llm = LLM(str(directory), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (5, 12)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    llm.shutdown()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("int4-errors")
    _, quantizer, config, _ = FORMATS["int4-group32"]
    qc.write_quantized(directory, "llama", quantizer, config)
    return directory


def _copy_with(source, destination, tensors=None, config_edit=None):
    os.makedirs(destination, exist_ok=True)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(source, file)):
            with open(os.path.join(source, file)) as f:
                text = f.read()
            with open(os.path.join(destination, file), "w") as f:
                f.write(text)
    all_tensors = qc.load_tensors(source)
    qc.save_tensors(destination, tensors(all_tensors) if tensors else all_tensors)
    if config_edit:
        path = os.path.join(destination, "config.json")
        with open(path) as f:
            config = json.load(f)
        config_edit(config["quantization_config"])
        with open(path, "w") as f:
            json.dump(config, f)
    return destination


def test_a_truncated_scale_tensor_names_the_tensor(int4_checkpoint, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight_scale"

    def truncate(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()
        return tensors

    bad = _copy_with(int4_checkpoint, tmp_path / "bad", tensors=truncate)
    with pytest.raises(
        CheckpointError, match=rf"tensor {name} .* has shape \[64, 3\] but the config needs \[64, 4\]"
    ):
        load_for_test(bad)


def test_a_wrong_group_size_names_the_scale_tensor(int4_checkpoint, tmp_path):
    def group_64(config):
        config["config_groups"]["group_0"]["weights"]["group_size"] = 64

    bad = _copy_with(int4_checkpoint, tmp_path / "bad", config_edit=group_64)
    with pytest.raises(
        CheckpointError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.weight_scale .* needs \[64, 1\]"
    ):
        load_for_test(bad)


def test_a_group_size_that_is_not_a_number_names_the_field(int4_checkpoint, tmp_path):
    def no_group(config):
        config["config_groups"]["group_0"]["weights"]["group_size"] = None

    bad = _copy_with(int4_checkpoint, tmp_path / "bad", config_edit=no_group)
    with pytest.raises(QuantizationError, match=r"group_0\.weights: strategy 'group' with group_size None"):
        load_for_test(bad)


def test_a_stored_weight_shape_that_disagrees_with_the_config_names_it(int4_checkpoint, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight_shape"

    def wrong_shape(tensors):
        tensors[name] = torch.tensor([128, 65])
        return tensors

    bad = _copy_with(int4_checkpoint, tmp_path / "bad", tensors=wrong_shape)
    with pytest.raises(CheckpointError, match=rf"{name} is \[128, 65\] but the config needs \[128, 64\]"):
        load_for_test(bad)


@pytest.mark.parametrize(
    "quantization_config,message",
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128},
            r"quantization format 'awq' is not supported; supported: compressed-tensors",
        ),
        ({"quant_method": "mxfp4"}, r"'mxfp4' is not supported; supported: .*gptq .*GGUF"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
            r"'gptq' \(desc_act true: act-order",
        ),
        (
            qc.compressed_tensors_config(
                {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                "nvfp4-pack-quantized",
            ),
            r"float weights of 4 bits in format 'nvfp4-pack-quantized' are not supported",
        ),
    ],
)
def test_unsupported_formats_fail_at_load_naming_the_format_and_what_is_supported(
    int4_checkpoint, tmp_path, quantization_config, message
):
    def replace(config):
        config.clear()
        config.update(quantization_config)

    bad = _copy_with(int4_checkpoint, tmp_path / "bad", config_edit=replace)
    with pytest.raises(QuantizationError, match=message):
        load_for_test(bad)


def test_the_start_up_tile_of_a_quantized_shape_is_the_one_its_kernel_runs(int4_checkpoint, monkeypatch):
    from tpfuse import knobs
    from tpfuse.kernels.quant_int import IntTile
    from tpfuse.model import linear_choice
    from tpfuse.model.quant import int_group

    model, _ = load_for_test(int4_checkpoint)
    layer = model.layers[0].mlp.down_proj
    tile = IntTile(16, 16, 32, 2, 4)
    monkeypatch.setitem(linear_choice._QUANT_TILES, (layer.method.tile_key(layer), 16), tile)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    seen = []
    real = int_group.int_linear_op

    def recording(*args, tile=None):
        seen.append(tile)
        return real(*args, tile=tile)

    monkeypatch.setattr(int_group, "int_linear_op", recording)
    x = torch.randn(5, layer.shards.k_local).half()
    out = layer(x)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    assert seen == [tile]
    torch.testing.assert_close(out.float(), layer(x.float()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "name,w8a8",
    [("fp8-channel", True), ("fp8-block", True), ("fp8-channel-qwen3-moe", False)],  # the last: weight-only
)
def test_fp8_decode_tiles_take_the_w8a8_form_only_where_the_format_quantizes_activations(
    name, w8a8, tmp_path, monkeypatch
):
    from tests.kernels.float64_linear import e4m3_exact_activations
    from tpfuse import knobs
    from tpfuse.kernels import quant_fp8_w8a8
    from tpfuse.model import linear_choice
    from tpfuse.model.quant import fp8

    kind, quantizer, config, shape = FORMATS[name]
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path)
    layer = model.layers[0].self_attn.o_proj
    assert layer.method.activations is w8a8
    monkeypatch.setattr(fp8, "fp8_dot_supported", lambda device: True)  # as on a GPU with FP8 tensor cores
    for bucket in linear_choice.BUCKETS:
        candidates = layer.method.tile_candidates(bucket, layer)
        chosen = [t for t in candidates if isinstance(t, quant_fp8_w8a8.W8A8Tile)]
        assert chosen == (list(quant_fp8_w8a8.W8A8_TILES[bucket]) if w8a8 else [])
    if not w8a8:
        return
    # a chosen W8A8 tile is the one the layer runs (interpreter), and it gives the decode form's reference
    tile = quant_fp8_w8a8.W8A8_TILES[1][0]
    monkeypatch.setitem(linear_choice._QUANT_TILES, (layer.method.tile_key(layer), 1), tile)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    seen = []
    real = fp8.fp8_linear_op

    def recording(*args, tile=None, **kwargs):
        seen.append(tile)
        return real(*args, tile=tile, **kwargs)

    monkeypatch.setattr(fp8, "fp8_linear_op", recording)
    group = quant_fp8_w8a8.decode_group(layer.fp8_block, layer.shards.k_local, tile)
    x = e4m3_exact_activations(1, layer.shards.k_local, group, torch.Generator().manual_seed(0))
    out = layer(x)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    assert seen == [tile]
    method = layer.method
    expected = x.double() @ method.dequantize(layer).double().T  # x quantizes exactly
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("what", ["weight", "weight_scale_inv"])
def test_nan_in_fp8_codes_or_scales_is_named(tmp_path_factory, tmp_path, what):
    source = tmp_path_factory.mktemp("fp8-block-nan")
    _, quantizer, config, _ = FORMATS["fp8-block"]
    qc.write_quantized(source, "llama", quantizer, config)
    name = f"model.layers.0.mlp.down_proj.{what}"

    def poison(tensors):
        tensor = tensors[name]
        if tensor.dtype == torch.float8_e4m3fn:
            tensor.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
        else:
            tensor[0, 0] = float("nan")
        return tensors

    bad = _copy_with(source, tmp_path / "bad", tensors=poison)
    with pytest.raises(CheckpointError, match=r"holds NaN or infinite values"):
        load_for_test(bad)


@pytest.mark.parametrize("k_rows,whole", [(128, True), (64, False)])
def test_block_fp8_keeps_the_checkpoint_blocks_only_where_every_part_is_whole_blocks(k_rows, whole):
    """The Triton prefill kernel's one-scale-a-tile form (TILE_SCALE) reads the checkpoint's 128 x 128
    scales as they are; merged parts off the 128-row grid (a 64-row k_proj) keep only per-row scales."""
    from types import SimpleNamespace

    from tpfuse.model.quant import fp8

    gen = torch.Generator().manual_seed(k_rows)
    parts = [(256, 0, 256), (k_rows, 0, k_rows)]  # (full, start, local) of q and k, merged
    raw = [torch.rand(-(-local // 128), 2, generator=gen) for _, _, local in parts]
    layer = torch.nn.Module()
    layer.shards = SimpleNamespace(parts=parts)
    layer.weight = torch.nn.Parameter(torch.zeros(256 + k_rows, 256), requires_grad=False)
    layer.block_scale_parts = torch.nn.ParameterList(torch.nn.Parameter(r, requires_grad=False) for r in raw)
    fp8.Fp8LinearMethod("block", (128, 128)).process_weights(layer)
    per_row = torch.cat([r.repeat_interleave(128, 0)[:p[2]] for r, p in zip(raw, parts, strict=True)])
    assert torch.equal(layer.weight_scale, per_row)
    assert torch.equal(layer.tile_scale, torch.cat(raw)) if whole else layer.tile_scale is None


def test_block_fp8_prefill_on_the_checkpoint_blocks_equals_float64(tmp_path, monkeypatch):
    """More than 64 rows through the Triton prefill route (interpreter) with the kept block scales."""
    from tests.kernels.float64_linear import e4m3_exact_activations
    from tpfuse import knobs
    from tpfuse.kernels.fp8_scaled_mm import TRITON_PREFILL
    from tpfuse.model.quant import fp8

    kind, quantizer, config, shape = FORMATS["fp8-block"]
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path)
    layer = model.layers[0].mlp.down_proj
    assert layer.tile_scale is not None
    monkeypatch.setattr(fp8, "fp8_dot_supported", lambda device: True)  # as on a GPU with FP8 tensor cores
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    x = e4m3_exact_activations(67, layer.shards.k_local, 128, torch.Generator().manual_seed(1))
    out = layer.method.product(layer, x, None, TRITON_PREFILL)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    expected = x.double() @ layer.method.dequantize(layer).double().T  # x quantizes exactly
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 16])
def test_block_fp8_decode_tiles_on_the_checkpoint_blocks_equal_float64(tmp_path, monkeypatch, rows):
    """Every W8A16 tile start-up may time at 1 and 16 rows reads the kept 128 x 128 scales (the
    GEMV puts them on x: X_SCALE) and gives the float64 product of the dequantized weight."""
    from tpfuse import knobs
    from tpfuse.kernels.quant_fp8 import FP8_TILES

    kind, quantizer, config, shape = FORMATS["fp8-block"]
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path)
    for layer in (model.layers[0].mlp.down_proj, model.layers[0].self_attn.qkv_proj):
        assert layer.tile_scale is not None
        x = torch.randn(rows, layer.shards.k_local, generator=torch.Generator().manual_seed(rows))
        expected = x.double() @ layer.method.dequantize(layer).double().T
        monkeypatch.setenv("TPFUSE_KERNELS", "triton")
        knobs.reload()
        for tile in FP8_TILES[rows]:
            out = layer.method.product(layer, x, None, tile)
            atol = 1e-4 * expected.abs().max().item()
            torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=atol)
        monkeypatch.setenv("TPFUSE_KERNELS", "torch")
        knobs.reload()


@pytest.mark.parametrize(
    "name,kernels", [("fp8-channel", "torch"), ("fp8-channel", "triton"), ("fp8-block", "torch"),
                     ("fp8-block", "triton")]
)  # fmt: skip
def test_fp8_rows_from_the_norms_give_the_logits_of_the_projections_own_quantization(
    name, kernels, tmp_path, monkeypatch
):
    """Where start-up timing chose FP8 rows for the projections that read a norm (qkv, gate_up), each
    fused norm writes FP8 rows (kernels/fp8_rows.py: a scale a row for per-channel weights, a
    128-column group for 128 x 128 blocks) and the prefill logits are the bits of the same model
    quantizing its own activations (TRITON_PREFILL), on the kernels' references and on the Triton
    kernels (interpreter); decode-sized steps never take them."""
    from tests.model.harness import prefill_logits_on_routes
    from tpfuse import knobs
    from tpfuse.comm.communicator import SingleRankCommunicator
    from tpfuse.kernels.fp8_scaled_mm import FP8_ROWS
    from tpfuse.model import linear_choice
    from tpfuse.model.input_forms import Fp8RowsForm
    from tpfuse.model.quant import fp8

    class CountingCommunicator(SingleRankCommunicator):
        groups = []

        def fused_add_rmsnorm_all_reduce_fp8_rows(self, x, residual, weight, eps, group):
            CountingCommunicator.groups.append(group)
            return super().fused_add_rmsnorm_all_reduce_fp8_rows(x, residual, weight, eps, group)

    kind, quantizer, config, shape = FORMATS[name]
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path, dtype="bfloat16", comm=CountingCommunicator())
    monkeypatch.setattr(fp8, "fp8_dot_supported", lambda device: True)  # as on a GPU with FP8 tensor cores
    monkeypatch.setattr(fp8, "use_triton", lambda x: True)  # the GPU's routes, on `kernels`
    monkeypatch.setenv("TPFUSE_KERNELS", kernels)
    knobs.reload()
    layer0 = model.layers[0]
    readers = (layer0.self_attn.qkv_proj, layer0.mlp.gate_up_proj)
    group = model.config.hidden_size if name == "fp8-channel" else 128
    offered = (Fp8RowsForm(group), (FP8_ROWS,))
    assert all(layer.method.form_candidates(layer, linear_choice.PREFILL) == offered for layer in readers)
    prompt = [random.Random(5).randrange(model.config.vocab_size) for _ in range(70)]
    own = prefill_logits_on_routes(model, prompt, None)
    assert CountingCommunicator.groups == []
    rows = prefill_logits_on_routes(model, prompt, FP8_ROWS)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    assert CountingCommunicator.groups == [group] * (2 * len(model.layers))  # every norm but the final one
    assert torch.equal(rows, own)
    linear_choice.set_form_route(readers[0], 65, FP8_ROWS)
    try:  # decode-sized steps take the plain tensor
        assert readers[0].method.input_form(readers[0], 64) is None
        assert readers[0].method.input_form(readers[0], 65) == Fp8RowsForm(group)
    finally:
        linear_choice.set_form_route(readers[0], 65, None)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_half2x_from_the_norms_and_silu_gives_the_decode_logits_of_the_plain_row(
    kernels, tmp_path, monkeypatch
):
    """Where start-up timing chose the f16x2 GEMV on Half2X for the INT4 projections that read a norm or
    SiLU-and-mul (qkv, gate_up, down; forced here), one-row steps write Half2X in those kernels
    (model/input_forms.py) and give the logits of the same tile on the plain row, on the kernels'
    references and on the Triton kernels (interpreter); a prompt's rows stay plain."""
    from tests.model.harness import decode_logits_on_half2x, relative_error
    from tpfuse import knobs
    from tpfuse.comm.communicator import SingleRankCommunicator
    from tpfuse.kernels.quant_int_half2 import Half2Tile
    from tpfuse.model import input_forms

    class CountingCommunicator(SingleRankCommunicator):
        calls = []

        def fused_add_rmsnorm_all_reduce_half2x(self, x, residual, weight, eps):
            CountingCommunicator.calls.append(x.shape[0])
            return super().fused_add_rmsnorm_all_reduce_half2x(x, residual, weight, eps)

    silu_rows = []
    silu_half2x = input_forms.silu_and_mul_half2x
    counted = lambda x: silu_rows.append(x.shape[0]) or silu_half2x(x)  # noqa: E731
    monkeypatch.setattr(input_forms, "silu_and_mul_half2x", counted)
    kind, quantizer, config, shape = FORMATS["int4-group32"]
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path, dtype="bfloat16", comm=CountingCommunicator())
    monkeypatch.setenv("TPFUSE_KERNELS", kernels)
    knobs.reload()
    qkv = model.layers[0].self_attn.qkv_proj
    form, routes = qkv.method.form_candidates(qkv, 1)
    assert form == input_forms.HALF2X and routes and all(isinstance(t, Half2Tile) for t in routes)
    assert qkv.method.form_candidates(qkv, 16) == (None, ())
    tile = Half2Tile(1, 4, 64, 1, 1)  # K = 64: one vector a thread, whole steps
    prompt, decode = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]
    plain = decode_logits_on_half2x(model, prompt, decode, tile, on_form=False)
    assert CountingCommunicator.calls == [] and silu_rows == []
    on_form = decode_logits_on_half2x(model, prompt, decode, tile, on_form=True)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    layers = len(model.layers)
    assert CountingCommunicator.calls == [1] * (2 * layers * len(decode))  # every norm but the final one
    assert silu_rows == [1] * (layers * len(decode))
    # bf16 x is exact in Half2X's f16 lanes but for values 2^12 below their vector's largest; the
    # products' fp32 sums run in another order
    assert relative_error(on_form, plain) < 2e-3
    assert torch.equal(on_form.argmax(-1), plain.argmax(-1))


def test_weight_only_fp8_offers_no_fp8_rows(tmp_path, monkeypatch):
    from tpfuse.model import linear_choice
    from tpfuse.model.quant import fp8

    kind, quantizer, config, shape = FORMATS["fp8-channel-qwen3-moe"]  # no input_activations: W8A16
    qc.write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path)
    monkeypatch.setattr(fp8, "fp8_dot_supported", lambda device: True)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.method.form_candidates(qkv, linear_choice.PREFILL) == (None, ())
    assert model.layers[0].self_attn.input_form(1000) is None
