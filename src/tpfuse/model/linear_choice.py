"""Which kernel runs each projection at 1-64 rows, measured per weight shape and row bucket at start-up.

Decode (1 row per sequence), a speculative verify (k + 1 rows per sequence) and small batches stream
every weight once per step, and how close a kernel comes to the memory bandwidth depends on the
weight's shape, the row count and the GPU, so the route is measured, never assumed. For each
distinct weight (shape, dtype, bias or not) among a model's projections and each row bucket up to
the most rows the engine's CUDA graphs use:
  - bucket 1 (one row): the one-row GEMV (kernels/gemv.py);
  - buckets 16, 32, 64 (2-16, 17-32, 33-64 rows, the padded MMA rows): each tile in TILES[bucket]
    of kernels/skinny_linear.py, the fastest kept;
against F.linear (cuBLAS), all timed at the bucket's largest row count by CUDA-graph replay over the
model's own weights of that shape (distinct tensors, so as L2-cold as in decode). The Triton route
is taken where it needs at most MARGIN of cuBLAS's time ($TPFUSE_LINEAR_MARGIN overrides it).
linear_method.linear then sends each input by its row count; more than 64 rows, and every unchosen case,
stay on F.linear.

The choice is process-wide, keyed by (shape, dtype, device, bias, bucket): engines and ranks sharing
a GPU share it, and a case is timed once. TPFUSE_LINEAR overrides it: auto (default, measured),
triton (every eligible case, the first tile of each bucket, untimed: tests), cublas (none).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from tpfuse import knobs
from tpfuse.gpu_timing import graph_us, stream_us
from tpfuse.kernels import gemv_op, skinny_linear_op
from tpfuse.kernels.fp8_scaled_mm import ScaledMmUnavailable
from tpfuse.kernels.quant_int import GemvTile, Half2Tile, IntTile, MagicTile
from tpfuse.kernels.skinny_linear import MAX_ROWS, Tile, row_bucket

log = logging.getLogger("tpfuse")

# A Triton route is taken where it needs at most MARGIN of cuBLAS's time, so timing noise does not flip
# a tie (why 0.98: docs/PERF.md, the linear-route margin).
MARGIN = 0.98
MARGIN_VARIABLE = knobs.LINEAR_MARGIN  # overrides MARGIN (benchmarks: what a margin costs or gains)
MODES = ("auto", "triton", "cublas")
GEMV = "gemv"  # the route of bucket 1
BUCKETS = (1, 16, 32, 64)
# Tiles tried per row bucket (the first, never split-K, is TPFUSE_LINEAR=triton's); start-up keeps the
# fastest per weight shape, or cuBLAS (how the candidates were picked: docs/PERF.md).
TILES: dict[int, tuple[Tile, ...]] = {
    16: (
        Tile(16, 64, 128, 5, 4, swap=True),  # qkv, gate_up
        Tile(16, 32, 256, 5, 4),  # o_proj
        Tile(16, 64, 128, 5, 4, swap=True, split_k=2),  # o_proj, down
        Tile(16, 128, 128, 3, 4, swap=True),  # lm_head
    ),
    32: (
        Tile(32, 64, 128, 3, 4),  # gate_up, lm_head
        Tile(32, 32, 128, 5, 4),  # o_proj
        Tile(32, 64, 128, 3, 4, swap=True, split_k=4),  # down
    ),
    64: (
        Tile(64, 64, 128, 3, 4),  # gate_up, lm_head
        Tile(64, 64, 128, 4, 8, split_k=2),  # down
    ),
}
Route = str | Tile  # GEMV or a skinny_linear tile
Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool, int]


@dataclass(frozen=True)
class Choice:
    """One (weight shape, row bucket) decision; the times are None when TPFUSE_LINEAR forced it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    route: Route | None  # None: cuBLAS
    cublas_us: float | None = None
    triton_us: float | None = None

    def describe(self) -> str:
        n, k = self.shape
        rows = "1 row" if self.bucket == 1 else f"<= {self.bucket} rows"
        if self.route is None:
            name = "cuBLAS"
        else:
            name = "Triton GEMV" if self.route == GEMV else f"Triton {self.route.label()}"
        if self.cublas_us is None:
            return f"{n}x{k} at {rows}: {name} (TPFUSE_LINEAR)"
        return f"{n}x{k} at {rows}: {name} ({self.triton_us:.1f} us vs cuBLAS {self.cublas_us:.1f} us)"


_DECIDED: dict[Key, Choice] = {}
_ROUTES: dict[Key, Route] = {}  # the chosen Triton routes only: the hot-path lookup


def bucket(rows: int) -> int | None:
    """The row bucket of `rows` rows (1, 16, 32 or 64), None past MAX_ROWS."""
    if rows == 1:
        return 1
    return row_bucket(rows) if 1 < rows <= MAX_ROWS else None


def _key(weight: torch.Tensor, bias: torch.Tensor | None, rows_bucket: int) -> Key:
    return (tuple(weight.shape), weight.dtype, weight.device, bias is not None, rows_bucket)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Route | None:
    """The Triton route of x @ weight.T (+ bias), or None for F.linear: a chosen (weight, bucket)
    and x 2-D and contiguous along K (one row: contiguous)."""
    if not _ROUTES or x.dim() != 2 or x.stride(1) != 1:
        return None
    rows_bucket = bucket(x.shape[0])
    if rows_bucket is None:
        return None
    return _ROUTES.get(_key(weight, bias, rows_bucket))


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1


def mode() -> str:
    value = knobs.current.linear
    if value not in MODES:
        raise ValueError(f"TPFUSE_LINEAR={value!r} is not one of {', '.join(MODES)}; unset it for auto")
    return value


def margin() -> float:
    """The largest share of cuBLAS's time a Triton route may need to be taken ($TPFUSE_LINEAR_MARGIN,
    else MARGIN)."""
    value = knobs.current.linear_margin
    if value is None:
        return MARGIN
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 0.0 < share <= 1.5:
        raise ValueError(f"{MARGIN_VARIABLE}={value!r} must be a number in (0, 1.5], e.g. 0.97; unset it")
    return share


def _candidates(rows_bucket: int) -> tuple[Route, ...]:
    return (GEMV,) if rows_bucket == 1 else TILES[rows_bucket]


def _time_us(
    weights: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int, route: Route | None
) -> float:
    """us per call of one route at `rows` rows, round-robin over weights (each its own output)."""
    weight = weights[0][0]
    x = torch.randn(rows, weight.shape[1], device=weight.device).to(weight.dtype)
    if route is None:
        calls = [lambda w=w, b=b: F.linear(x, w, b) for w, b in weights]
    elif route == GEMV:
        calls = [lambda w=w, b=b: gemv_op(x, w, b) for w, b in weights]
    else:
        calls = [lambda w=w, b=b: skinny_linear_op(x, w, b, tile=route) for w, b in weights]
    big = weight.numel() * weight.element_size() > (64 << 20)
    return graph_us(calls, min_launches=8 if big else 32, replays=5, samples=3)


def _decide(key: Key, weights, how: str, timer) -> Choice:
    shape, dtype, rows_bucket = key[0], key[1], key[4]
    candidates = _candidates(rows_bucket)
    if how != "auto":
        return Choice(shape, dtype, rows_bucket, candidates[0] if how == "triton" else None)
    cublas_us = timer(weights, rows_bucket, None)
    triton_us, best = min((timer(weights, rows_bucket, c), i) for i, c in enumerate(candidates))
    chosen = candidates[best] if triton_us <= margin() * cublas_us else None
    return Choice(shape, dtype, rows_bucket, chosen, cublas_us, triton_us)


@torch.inference_mode()
def choose(
    projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
    max_rows: int = 1,
    time_us=None,
    agree=None,
) -> list[Choice]:
    """Decides every new (weight, bias) shape among projections (layers.projections(model)) at each
    row bucket up to max_rows' and returns this call's decisions; cases decided before (another
    engine, another rank) are kept. Runs on the GPU before any model CUDA graph is captured (it
    captures its own, and runs every chosen tile once, allocating its split-K buffers).
    time_us(weights, rows, route) -> us per call (route None: cuBLAS) replaces the measurement
    (tests); without it, auto decides nothing on CPU (F.linear throughout).
    agree(choices) -> choices: for tensor-parallel ranks, every rank passes its decisions (a list of
    Choice, in projection order) and gets rank 0's, so all ranks run the same kernels (drafts and
    sums stay bit-identical even where the timings would differ by rank)."""
    how = mode()
    top = bucket(min(max(max_rows, 1), MAX_ROWS))
    groups: dict[Key, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in projections:
        if not _eligible(weight):
            continue
        for rows_bucket in BUCKETS:
            key = _key(weight, bias, rows_bucket)
            if rows_bucket <= top and key not in _DECIDED:
                groups.setdefault(key, []).append((weight, bias))
    decided_keys, decided = [], []
    for key, weights in groups.items():
        if how == "auto" and time_us is None and not weights[0][0].is_cuda:
            continue
        decided_keys.append(key)
        decided.append(_decide(key, weights, how, time_us or _time_us))
    if agree is not None:
        decided = agree(decided)
        mine = [(k[0], k[4]) for k in decided_keys]
        if mine != [(c.shape, c.bucket) for c in decided]:
            mismatch = sorted(set(mine) ^ {(c.shape, c.bucket) for c in decided})
            raise RuntimeError(f"tensor-parallel ranks decided different projection cases: {mismatch[:3]}")
    for key, choice in zip(decided_keys, decided, strict=True):
        _DECIDED[key] = choice
        if choice.route is not None:
            _ROUTES[key] = choice.route
    if decided:
        log.info("projection routes: %s", "; ".join(c.describe() for c in decided))
    return decided


def decisions() -> list[Choice]:
    """Every decision made in this process so far."""
    return list(_DECIDED.values())


def reset() -> None:
    """Forgets every decision (tests)."""
    _DECIDED.clear()
    _ROUTES.clear()
    _QUANT_TILES.clear()


# Quantized methods (model/quant/): the tile of their kernels per (method, weight shape, row bucket),
# timed the same way over the model's own layers of that shape; there is no cuBLAS route to race.
# A method that takes part exposes product(layer, x, bias, tile) and tile_key(layer) (its name and
# shape), and may expose tile_candidates(bucket) (else QUANT_TILES, the integer kernels'). Candidates
# are few (each is a compile at start-up). Bucket 1: kernels/quant_int_half2.py's f16x2 GEMV (about
# 2.2 instructions per weight on sm_90) at the tiles that won its sweep at each llama-3.1-8b shape
# (docs/PERF.md: 1.2-1.35x the fp32 forms below on the H100) and with K split over 2-4 programs (more
# programs, 64-72 registers, where 4096 rows left an H100 at 7 warps an SM: docs/PERF.md), and for the
# layouts it does not take
# (8 bits, fp32 x, groups splitting a 32-code vector) the GEMV of kernels/quant_int.py and two forms
# of kernels/quant_int_gemv.py (GemvTile: fp32 products, 3.1-3.4 instructions per weight), and
# kernels/quant_int_magic.py's tensor-core form (128 rows x 128 columns, split-K; it lost to the
# GEMVs wherever it was timed, and stays a candidate for GPUs where the tensor cores may win);
# 16-64 rows the tl.dot tile with the weight as the MMA's M side (64 rows, swap), x (32 columns,
# twice the programs for the 4096-row projections), or split-K (o_proj / down: 64 of 132 SMs busy
# otherwise; at 64 rows 128 weight rows a program, so x is re-read from L2 half as often).
QUANT_TILES: dict[int, tuple[IntTile, ...]] = {
    1: (Half2Tile(1, 4, 2048, 1, 1), Half2Tile(1, 2, 4096, 1, 1), Half2Tile(1, 4, 4096, 1, 2),
        Half2Tile(1, 2, 2048, 1, 1, split_k=2), Half2Tile(1, 4, 1024, 1, 1, split_k=4),
        IntTile(1, 8, 1024, 1, 4), GemvTile(1, 16, 2048, 1, 2), GemvTile(1, 8, 2048, 1, 2, pin=True),
        MagicTile(1, 128, 128, 1, 4), MagicTile(1, 128, 128, 1, 4, split_k=2),
        MagicTile(1, 128, 128, 1, 4, split_k=4), MagicTile(1, 128, 128, 4, 4, split_k=2)),
    **{
        b: (IntTile(b, 64, 128, 3, 4, swap=True), IntTile(b, 32, 128, 3, 4),
            IntTile(b, 64, 128, 3, 4, swap=True, split_k=2))
        for b in (16, 32)
    },
    64: (IntTile(64, 64, 128, 3, 4, swap=True), IntTile(64, 32, 128, 3, 4),
         IntTile(64, 128, 128, 3, 8, swap=True, split_k=4)),
}  # fmt: skip
_QUANT_TILES: dict[tuple, IntTile] = {}
# The bucket of products past MAX_ROWS (prefill): methods with more than one way to run them
# (prefill_candidates) have it timed at the engine's prefill chunk, over PREFILL_LAYERS layers a shape.
PREFILL = "prefill"
PREFILL_LAYERS = 2
# A method's routes on input its producer writes in another form (form_candidates(layer, bucket) ->
# (form, routes); model/input_forms.py: FP8 rows past MAX_ROWS, Half2X at one row), timed without
# making that form and kept only where one beats the bucket's route on the plain tensor: the layer then
# asks for the form (its method's input_form), and a producer that cannot write it still gets the plain
# route. Kept under FormBucket(bucket).


@dataclass(frozen=True)
class FormBucket:
    """The _QUANT_TILES bucket of the route on a layer's input form at rows_bucket (1 .. MAX_ROWS or
    PREFILL)."""

    rows_bucket: int | str

    def __str__(self) -> str:
        return f"{self.rows_bucket} rows on the input form"


def _bucket_text(rows_bucket) -> str:
    return str(rows_bucket) if isinstance(rows_bucket, FormBucket) else f"{rows_bucket} rows"


# Off from the reference by more than this share of its largest value, a candidate is wrong, not
# rounded: W8A8 tiles quantize x to e4m3 (a few % per output), a wrong scale or layout is off by ~100 %.
AGREEMENT = 0.1


class DisagreesWithReference(RuntimeError):
    """A candidate tile's product is not the layer's product (checked once, before it is timed)."""


# A candidate that fails to compile, to fit the GPU or to agree with the reference is left out of the
# timing, not fatal: it is one of several, and the tests on the GPU check every candidate's results.
_UNFIT = (
    ScaledMmUnavailable,
    triton.runtime.errors.OutOfResources,
    triton.compiler.errors.CompilationError,
    DisagreesWithReference,
    *((triton.runtime.errors.PTXASError,) if hasattr(triton.runtime.errors, "PTXASError") else ()),
)


def check_agrees(out: torch.Tensor, reference: torch.Tensor, label: str) -> None:
    """Raises DisagreesWithReference unless out is finite and within AGREEMENT of reference (both
    [rows, N]; reference float32)."""
    error = (out.float() - reference).abs().max().item() if out.numel() else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    if not (error <= AGREEMENT * scale) or not torch.isfinite(out).all():
        raise DisagreesWithReference(f"{label}: off by {error:.3g} against a largest value of {scale:.3g}")


def _quant_bucket(rows: int):
    return bucket(rows) if rows <= MAX_ROWS else PREFILL


def quant_tile(layer, rows: int):
    """The chosen tile for a quantized layer at `rows` rows (past MAX_ROWS: its PREFILL route), None
    where nothing was chosen (the kernel's default)."""
    if not _QUANT_TILES:
        return None
    rows_bucket = _quant_bucket(rows)
    return None if rows_bucket is None else _QUANT_TILES.get((layer.method.tile_key(layer), rows_bucket))


def _quant_candidates(layer, rows_bucket) -> tuple:
    method = layer.method
    if rows_bucket == PREFILL:
        return tuple(method.prefill_candidates(layer)) if hasattr(method, "prefill_candidates") else ()
    if hasattr(method, "tile_candidates"):
        return method.tile_candidates(rows_bucket, layer)
    return QUANT_TILES[rows_bucket]


def _form_candidates(layer, rows_bucket) -> tuple:
    """(form, routes) of the layer's method at rows_bucket (form_candidates; model/input_forms.py), or
    (None, ()) where it has none."""
    method = layer.method
    return method.form_candidates(layer, rows_bucket) if hasattr(method, "form_candidates") else (None, ())


def _quant_timers(layers, rows: int):
    """timer(form=None) -> time_us(tile) for fastest: the tile's product at `rows` rows over the layers
    (one product a layer), checked once against the first layer's dequantized weight, timed as it will
    run: replayed from a CUDA graph at decode sizes, eagerly past MAX_ROWS (the engine's prompt chunks
    are larger than its piecewise graphs take). form: the input made beforehand in that form
    (model/input_forms.py: its producer's work, so it is not timed). One input and reference for all."""
    first = layers[0]
    x = torch.randn(rows, first.shards.k_local, device=next(first.parameters()).device).to(torch.bfloat16)
    dequantize = getattr(first.method, "dequantize", None)
    reference = x.float() @ dequantize(first).float().T if dequantize is not None else None

    def timer(form=None):
        x_in = form.make(x) if form is not None else x

        def time_us(tile):
            if reference is not None:
                check_agrees(first.method.product(first, x_in, None, tile), reference, tile.label())
            calls = [lambda layer=layer: layer.method.product(layer, x_in, None, tile) for layer in layers]
            if rows <= MAX_ROWS:
                return graph_us(calls, min_launches=16, replays=5, samples=3)
            every_layer = lambda: [call() for call in calls]  # noqa: E731
            return statistics.median(stream_us(every_layer, repeats=3) for _ in range(3)) / len(calls)

        return time_us

    return timer


def form_route(layer, rows: int):
    """The route chosen for the layer's input in its method's input form at `rows` rows, or None: the
    layer takes the plain tensor."""
    rows_bucket = _quant_bucket(rows)
    if rows_bucket is None or not _QUANT_TILES:
        return None
    return _QUANT_TILES.get((layer.method.tile_key(layer), FormBucket(rows_bucket)))


def set_form_route(layer, rows: int, route) -> None:
    """Makes `route` the layer's choice on its input form at `rows` rows for every layer of its
    (method, shape); None forgets it (benchmarks, tests)."""
    _set_quant_choice((layer.method.tile_key(layer), FormBucket(_quant_bucket(rows))), route)


def set_quant_tile(layer, rows: int, tile) -> None:
    """Makes `tile` the layer's choice at `rows` rows for every layer of its (method, shape); None
    forgets it (benchmarks racing the routes side by side, tests)."""
    _set_quant_choice((layer.method.tile_key(layer), _quant_bucket(rows)), tile)


def _set_quant_choice(key: tuple, choice) -> None:
    """Records choice for key in _QUANT_TILES; None forgets it."""
    if choice is None:
        _QUANT_TILES.pop(key, None)
    else:
        _QUANT_TILES[key] = choice


def fastest(candidates, time_us, what: str) -> tuple:
    """(tile, us) of the candidate time_us(tile) finds fastest; one that fails to build, fit or agree
    (_UNFIT) is logged and left out. Raises RuntimeError naming `what` when none is left."""
    times = []
    for tile in candidates:
        try:
            times.append(time_us(tile))
        except _UNFIT as error:  # e.g. shared memory on smaller GPUs, or this Triton's compiler
            log.warning("quantized tile %s left out (%s)", tile.label(), error)
            times.append(float("inf"))
    if not times or min(times) == float("inf"):
        raise RuntimeError(f"no candidate tile of {what} builds, fits and agrees with the reference here")
    best = min(range(len(candidates)), key=times.__getitem__)
    return candidates[best], times[best]


@torch.inference_mode()
def choose_quantized(
    models, max_rows: int = 1, agree=None, buckets: Iterable[int] = BUCKETS, prefill_rows: int | None = None
) -> list[tuple]:
    """Times the candidate tiles for every quantized (method, shape) among the models' layers at each
    row bucket up to max_rows (among `buckets`; unchosen buckets run the kernel's default tile) and
    keeps the fastest (TPFUSE_LINEAR=triton: the first, untimed); with prefill_rows, also the PREFILL
    route of methods that offer prefill_candidates, timed at that many rows. CUDA only, before any
    graph capture. agree: as in choose (rank 0's decisions for every rank). Returns
    [(tile_key, bucket, tile, us)]."""
    how = mode()
    top = bucket(min(max(max_rows, 1), MAX_ROWS))
    cases = [(b, b) for b in buckets if b <= top] + ([(PREFILL, prefill_rows)] if prefill_rows else [])
    groups: dict[tuple, list] = {}
    for model in models:
        for layer in model.modules():
            method = getattr(layer, "method", None)
            key = method.tile_key(layer) if hasattr(method, "tile_key") else None
            if key is not None and next(layer.parameters()).is_cuda:
                groups.setdefault(key, []).append(layer)
    decided = []
    for key, layers in groups.items():
        for rows_bucket, rows in cases:
            if (key, rows_bucket) in _QUANT_TILES:
                continue
            candidates = _quant_candidates(layers[0], rows_bucket)
            if len(candidates) < (2 if rows_bucket == PREFILL else 1):
                continue  # nothing to choose: the method's default runs
            if how != "auto":
                decided.append((key, rows_bucket, candidates[0], None))
                continue
            # Past MAX_ROWS a product is compute-bound and its outputs large: a few layers suffice.
            timed = layers[:PREFILL_LAYERS] if rows_bucket == PREFILL else layers
            timer = _quant_timers(timed, rows)
            decided.append((key, rows_bucket, *fastest(candidates, timer(), f"{key} at {rows} rows")))
            form, form_routes = _form_candidates(layers[0], rows_bucket)
            if form_routes:
                try:
                    route, us = fastest(form_routes, timer(form), f"{key} on {form}")
                except RuntimeError:  # none builds here: the layer takes the plain tensor
                    continue
                if us < decided[-1][3]:
                    decided.append((key, FormBucket(rows_bucket), route, us))
    if agree is not None:
        decided = agree(decided)
    for key, rows_bucket, tile, _ in decided:
        _QUANT_TILES[(key, rows_bucket)] = tile
    if decided:
        log.info(
            "quantized tiles: %s",
            "; ".join(
                f"{k} at {_bucket_text(b)}: {t.label()}" + (f" ({us:.1f} us)" if us else "")
                for k, b, t, us in decided
            ),
        )
    return decided
