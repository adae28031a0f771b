"""load_model: builds the model for one rank and fills its weights from safetensors or at random.

Each rank reads only its shard of every tensor (safetensors `get_slice`), converting stored
float32/bfloat16/float16 to the run dtype. Bad input fails once, with an error that names the file,
tensor or value and the fix; a partial load is never returned.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import re
import zlib
from collections import Counter

import torch

from tpfuse.config import EngineConfig
from tpfuse.model import gguf, quant
from tpfuse.model.config import ModelConfig
from tpfuse.model.gguf import GgufFile, is_gguf
from tpfuse.model.layers import ParallelContext, ShardSlot
from tpfuse.model.linear_method import QuantConfig, linear_methods, process_all
from tpfuse.model.presets import PRESETS, is_preset, preset_config
from tpfuse.model.quant.common import json_kind
from tpfuse.model.quant.gguf import GgufConfig
from tpfuse.model.registry import model_class

log = logging.getLogger("tpfuse")

INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the culprit and the fix."""


def read_json(path: str) -> dict | None:
    """The JSON object in path (None: no such file). Raises CheckpointError for invalid JSON or a
    top level that is not an object."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore the file from the checkpoint") from e
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} must hold a JSON object, got {json_kind(data)}; restore the file from the checkpoint"
        )
    return data


def load_model_config(engine_config: EngineConfig) -> ModelConfig:
    """ModelConfig of --model (a preset name, a local Hugging Face directory or a .gguf file) with
    --dtype applied."""
    model = engine_config.model
    if is_preset(model):
        return preset_config(model, engine_config.dtype)
    if is_gguf(model):
        return ModelConfig.from_hf_dict(open_gguf(model).hf_config(), engine_config.dtype, None, source=model)
    if not os.path.isdir(model):
        raise CheckpointError(
            f"--model {model!r} is neither a local directory, a .gguf file nor a preset; "
            f"presets: {', '.join(PRESETS)}"
        )
    config_path = os.path.join(model, "config.json")
    hf = read_json(config_path)
    if hf is None:
        raise CheckpointError(
            f"{config_path} not found; --model must be a Hugging Face checkpoint directory with config.json"
        )
    generation = read_json(os.path.join(model, "generation_config.json"))
    return ModelConfig.from_hf_dict(hf, engine_config.dtype, generation, source=config_path)


def load_model(
    engine_config: EngineConfig, parallel: ParallelContext, device: torch.device | str
) -> tuple[torch.nn.Module, ModelConfig]:
    """Builds this rank's model (the class model/registry.py names for its architecture) on device
    and fills its weights. The model declares its checkpoint tensors (checkpoint_slots()), so this
    file knows no family.

    Presets and --load-format dummy get seeded random weights (normal(0, 0.02), norm weights 1), the
    same on every tp size. Raises CheckpointError (a ValueError) naming the missing file or tensor,
    the mismatched shape or the unsupported dtype; ValueError for an unsupported architecture.
    """
    model_config = load_model_config(engine_config)
    quant_config = load_quant_config(engine_config)
    with torch.device(device), linear_methods(quant_config):
        model = model_class(model_config.architecture)(model_config, parallel)
    if quant_config is not None:
        log.info("quantization: %s", quant_config.name)
    slots = model.checkpoint_slots()
    if is_preset(engine_config.model) or engine_config.load_format == "dummy":
        fill_dummy_weights(slots, engine_config.seed)
    elif is_gguf(engine_config.model):
        load_gguf(model, slots, open_gguf(engine_config.model))
        check_finite(model, engine_config.model)
    else:
        load_safetensors(model, slots, engine_config.model)
        check_finite(model, engine_config.model)
    check_all_parameters_written(model, slots)
    try:
        process_all(model)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {engine_config.model}: {e}") from e
    if quant_config is not None:
        log.info("weights by method: %s", method_summary(model))
    return model.eval(), model_config


def method_summary(model: torch.nn.Module) -> str:
    """'name xN' for every linear and expert method of the model (first-seen order), e.g.
    'fp8-block 128x128 x244, fp8-block 128x128 dequantized at load (...) x61, unquantized x1'."""
    counts = Counter(
        getattr(module.method, "name", type(module.method).__name__)
        for module in model.modules()
        if getattr(module, "method", None) is not None
    )
    return ", ".join(f"{name} x{n}" for name, n in counts.items())


def load_quant_config(engine_config: EngineConfig) -> QuantConfig | None:
    """The checkpoint's quantization (config.json's quantization_config), or --quantization's for
    dummy weights. Raises QuantizationError (a ValueError) naming an unsupported format or field."""
    dummy = is_preset(engine_config.model) or engine_config.load_format == "dummy"
    stored = None
    if is_gguf(engine_config.model):
        stored = GgufConfig(open_gguf(engine_config.model))
    elif not is_preset(engine_config.model):
        config_path = os.path.join(engine_config.model, "config.json")
        stored = quant.from_hf_config(read_json(config_path) or {}, config_path)
    if engine_config.quantization is None:
        return stored
    if not dummy:
        raise CheckpointError(
            f"--quantization {engine_config.quantization} makes random quantized weights and needs "
            "--load-format dummy or a preset; a checkpoint's quantization comes from its config.json"
        )
    return quant.for_dummy(engine_config.quantization)


CPU_DRAW_MAX_ELEMENTS = 1 << 22


def fill_dummy_weights(slots: dict[str, ShardSlot], seed: int) -> None:
    """Each tensor is drawn whole from a generator seeded by (seed, name) and then sliced, so every
    rank of every tp size holds the same weights as a TP=1 run with that seed. Tensors of up to
    CPU_DRAW_MAX_ELEMENTS are drawn on the CPU, so small models (the embedded default) get the same
    weights on every device; larger ones are drawn on their device, for speed (CPU and CUDA random
    streams differ). An expert's tensor counts as the stacked parameter it is one entry of (E times
    its size), so a large MoE is drawn on its device."""
    for name, slot in slots.items():
        dest = slot.destination()
        if name.endswith("norm.weight"):
            dest.fill_(1.0)
            continue
        numel = math.prod(slot.full_shape)
        if slot.index is not None:
            numel *= slot.param.shape[0]
        draw_on = torch.device("cpu") if numel <= CPU_DRAW_MAX_ELEMENTS else dest.device
        generator = torch.Generator(draw_on).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if slot.dummy is not None:  # quantized codes and scales: the method draws its own
            generator = torch.Generator(dest.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            slot.dummy(dest, generator)
            continue
        full = torch.empty(slot.full_shape, dtype=torch.float32, device=draw_on)
        full.normal_(0.0, 0.02, generator=generator)
        dest.copy_(full[slot.source_index()].to(dest.device))


def checkpoint_files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the *.safetensors present."""
    index = read_json(os.path.join(directory, INDEX_FILE))
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(
                f"{os.path.join(directory, INDEX_FILE)}: weight_map must be an object (tensor name -> shard "
                f"file), got {json_kind(weight_map)}; restore the index from the checkpoint"
            )
        root = os.path.normpath(directory) + os.sep  # as written: shards may be symlinks (HF cache)
        for name, file in weight_map.items():
            if not isinstance(file, str) or not os.path.normpath(os.path.join(root, file)).startswith(root):
                raise CheckpointError(
                    f"{INDEX_FILE} places {name} in {file!r}, which is not a file name inside {directory}; "
                    "fix the index (shards must sit beside it)"
                )
        files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise CheckpointError(
                    f"{file} is listed in {INDEX_FILE} but missing; download the complete checkpoint"
                )
        return files
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    # Mistral repositories ship consolidated.safetensors (native names) beside the Hugging Face files.
    hf_paths = [p for p in paths if not os.path.basename(p).startswith("consolidated")]
    paths = hf_paths or paths
    if not paths:
        raise CheckpointError(
            f"no *.safetensors weight files in {directory}; add the checkpoint's weights "
            "or run with --load-format dummy"
        )
    files = {}
    for path in paths:
        with _safetensors(path) as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


@contextlib.contextmanager
def _safetensors(path: str):
    """safe_open(path), its errors (a truncated or foreign file: header or data) as CheckpointError
    naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(
            f"{path} could not be read as safetensors ({exc}); the file is truncated or damaged: "
            "re-download it"
        ) from None


def load_safetensors(model: torch.nn.Module, slots: dict[str, ShardSlot], directory: str) -> None:
    """Copies this rank's shard of every checkpoint tensor into the model. Raises CheckpointError
    for a missing tensor (named with the file it should be in), a shape or dtype that does not match,
    or tensors the model has no place for."""
    files = checkpoint_files(directory)
    missing = [name for name in slots if name not in files]
    if missing:
        expected = "/".join(sorted({os.path.basename(f) for f in files.values()}))
        if INDEX_FILE in os.listdir(directory):
            expected = f"{INDEX_FILE} (and its shards)"
        raise CheckpointError(
            f"checkpoint {directory} is missing {len(missing)} tensor(s) the config needs, e.g. "
            f"{_listing(missing)}; expected in {expected}. Check that config.json matches the weights."
        )
    unexpected = [n for n in files if n not in slots and not model.is_ignorable_tensor(n)]
    if unexpected:
        raise CheckpointError(
            f"checkpoint {directory} has {len(unexpected)} tensor(s) that config.json has no place for: "
            f"{_listing(unexpected)} (in {os.path.basename(files[unexpected[0]])}). "
            "Check num_hidden_layers, the architecture and tie_word_embeddings in config.json."
        )
    copy_tensors(slots, files)


def copy_tensors(slots: dict[str, ShardSlot], files: dict[str, str]) -> None:
    """Copies this rank's shard of every tensor named in slots from its file (files: name -> path,
    as checkpoint_files returns; every name must be there). Raises CheckpointError."""
    by_file: dict[str, list[str]] = {}
    for name in slots:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with _safetensors(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"{path} is missing tensor {name}, which {INDEX_FILE} places there; "
                        "re-download that shard"
                    )
                _copy_slice(f.get_slice(name), slots[name], name, path)


def open_gguf(path: str) -> GgufFile:
    """The parsed file (memory-mapped; parsed once per process). Raises CheckpointError."""
    try:
        return gguf.open_gguf(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def load_gguf(model: torch.nn.Module, slots: dict[str, ShardSlot], file: GgufFile) -> None:
    """Copies this rank's shard of every tensor of a GGUF file into the model: Q8_0/Q4_0/Q4_1
    linears as codes (the slots of model/quant/gguf.py), everything else dequantized. Logs which."""
    sources = {name: _gguf_source(name) for name in slots}
    missing = sorted({source for source in sources.values() if source not in file.tensors})
    if missing:
        raise CheckpointError(f"{file.path} has no tensor {_listing(missing)}; is it a complete model file?")
    unexpected = [n for n in file.tensors if n not in set(sources.values())]
    if unexpected:
        raise CheckpointError(f"{file.path} has tensors the model has no place for: {_listing(unexpected)}")
    converted: dict[str, dict[str, torch.Tensor]] = {}
    kept, dequantized = [], []
    for name, slot in slots.items():
        base, _, suffix = name.rpartition(".")
        if suffix in _GGUF_CODES:
            if base not in converted:
                converted[base] = file.group_quantized(sources[name])
                kept.append(f"{base} {file.tensor_type(sources[name])}")
            source = converted[base][suffix]
        else:
            source = file.dequantized(name)
            dequantized.append(f"{name} {file.tensor_type(name)}")
        if not slot.accepts_shape(tuple(source.shape)):
            raise CheckpointError(
                f"{file.path}: tensor {name} has shape {list(source.shape)} but the model needs "
                f"{list(slot.full_shape)}; the file's metadata and tensors disagree"
            )
        if slot.length:
            slot.destination().copy_(source[slot.source_index()])
    log.info(
        "GGUF %s: %d linears run by the group-quantized kernels (%s); %d tensors dequantized at load (%s)",
        os.path.basename(file.path), len(kept), _per_layer(kept), len(dequantized), _per_layer(dequantized),
    )  # fmt: skip


_LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


def _per_layer(entries: list[str]) -> str:
    """'name TYPE' entries with the layer index folded and counted, in first-seen order:
    'model.layers.*.mlp.up_proj Q4_1 x30', so every tensor of any model size is accounted for."""
    counts = Counter(_LAYER_INDEX.sub(".layers.*.", entry) for entry in entries)
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items())


_GGUF_CODES = ("weight_packed", "weight_scale", "weight_offset")


def _gguf_source(name: str) -> str:
    """The file tensor a slot reads: a linear's codes and scales all come from its weight."""
    base, _, suffix = name.rpartition(".")
    return f"{base}.weight" if suffix in _GGUF_CODES else name


def _copy_slice(source, slot: ShardSlot, name: str, path: str) -> None:
    shape = tuple(source.get_shape())
    if not slot.accepts_shape(shape):
        needed = "one value ([] or [1])" if slot.broadcast else str(list(slot.full_shape))
        raise CheckpointError(
            f"tensor {name} in {path} has shape {list(shape)} but the config needs {needed}; "
            "check config.json (and its quantization_config) against the checkpoint"
        )
    dtype = source.get_dtype()
    if dtype not in slot.stored_dtypes:
        raise CheckpointError(
            f"tensor {name} in {path} is stored as {dtype}; tpfuse expects {' or '.join(slot.stored_dtypes)} "
            "there (check that config.json's quantization_config matches the weights)"
        )
    if slot.length:
        data = source[...] if slot.broadcast else source[slot.source_index()]
        slot.destination().copy_(data)


def check_all_parameters_written(model: torch.nn.Module, slots: dict[str, ShardSlot]) -> None:
    """Every element of every parameter must be the destination of exactly one slot (vocabulary
    padding rows are zeroed at construction); otherwise the model would run on uninitialized
    memory. Raises RuntimeError naming the parameter (a bug in checkpoint_slots)."""
    covered: dict[int, int] = {}
    for slot in slots.values():
        target = slot.param if slot.index is None else slot.param[slot.index]
        elements = (slot.length + slot.zero_rows) * (target.numel() // target.shape[slot.dim])
        covered[id(slot.param)] = covered.get(id(slot.param), 0) + elements
    for name, param in model.named_parameters():
        if covered.get(id(param), 0) != param.numel():
            raise RuntimeError(
                f"parameter {name} {list(param.shape)}: {covered.get(id(param), 0)} of {param.numel()} "
                "elements are mapped to checkpoint tensors; the rest would never be written"
            )


def check_finite(model: torch.nn.Module, source: str) -> None:
    """Raises CheckpointError naming the first weight that holds NaN or infinity: a damaged checkpoint
    would otherwise load and give the same token for ever. One device sync for the whole model."""
    tensors = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.numel()]
    if not tensors:
        return
    finite = torch.stack([_all_finite(t).to(tensors[0][1].device) for _, t in tensors])
    if bool(finite.all()):
        return
    name = tensors[int((~finite).nonzero()[0])][0]
    raise CheckpointError(
        f"checkpoint {source}: weight {name} holds NaN or infinite values; the file is damaged: "
        "re-download it"
    )


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:  # no infinity; NaN is S.1111.111
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:  # other FP8 kinds
        return torch.isfinite(t.to(torch.float16)).all()
    if t.dtype.is_floating_point:
        return torch.isfinite(t).all()
    return torch.ones((), dtype=torch.bool, device=t.device)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
