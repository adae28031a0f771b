"""Engine, speculative-decoding and server settings: one source for the CLI flags.

Each dataclass checks itself in __post_init__, so a bad value fails at start-up with a message
that names the flag. `add_*_args` registers the flags on an argparse parser and `from_args`
builds the dataclass back from the parsed namespace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

SPECULATIVE_ALGORITHMS = ("eagle3", "ngram", "draft", "mtp")


@dataclass(slots=True)
class SpeculativeConfig:
    algorithm: str | None = None  # None: no speculation
    draft_model_path: str | None = None  # EAGLE-3 head directory or draft model (dir or preset)
    num_steps: int = 3  # draft depth
    eagle_topk: int = 1  # 1: chain drafting; > 1: tree drafting
    num_draft_tokens: int | None = None  # tree size; chain: num_steps + 1
    adaptive: bool = True  # choose the number of draft tokens per step, zero included
    simulate_acceptance_length: float | None = None  # benchmark-only: fake acceptance

    def __post_init__(self):
        if self.algorithm is not None and self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"--speculative-algorithm {self.algorithm!r} is not supported; "
                f"choose one of {', '.join(SPECULATIVE_ALGORITHMS)}"
            )
        if self.algorithm is None:  # the other settings would be ignored without a word
            unused = [
                _spec_flag(f.name, getattr(self, f.name))
                for f in fields(self)
                if f.name not in ("algorithm", "num_draft_tokens") and getattr(self, f.name) != f.default
            ]
            if self.num_draft_tokens not in (None, self.num_steps + 1):  # num_steps + 1: derived below
                unused.append(_spec_flag("num_draft_tokens", self.num_draft_tokens))
            if unused:
                raise ValueError(
                    f"{', '.join(unused)}: no effect without --speculative-algorithm; add "
                    f"--speculative-algorithm ({', '.join(SPECULATIVE_ALGORITHMS)}) or drop "
                    f"{'it' if len(unused) == 1 else 'them'}"
                )
        if self.algorithm == "ngram" and self.draft_model_path is not None:
            raise ValueError(
                f"--speculative-draft-model-path {self.draft_model_path}: --speculative-algorithm ngram "
                "reads no draft model (its drafts come from the prompt and the output so far); drop it, "
                "or use --speculative-algorithm draft or eagle3"
            )
        if self.num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"--speculative-eagle-topk must be >= 1, got {self.eagle_topk}")
        if self.num_draft_tokens is None:
            self.num_draft_tokens = self.num_steps + 1
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                "with --speculative-eagle-topk 1 (chain drafting) --speculative-num-draft-tokens must be "
                f"--speculative-num-steps + 1 = {self.num_steps + 1}, got {self.num_draft_tokens}"
            )
        if self.simulate_acceptance_length is not None and not (
            1.0 <= self.simulate_acceptance_length <= self.num_steps + 1
        ):
            raise ValueError(
                "--speculative-simulate-acceptance-length must lie in [1, num_steps + 1] = "
                f"[1, {self.num_steps + 1}], got {self.simulate_acceptance_length}"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None


def _spec_flag(name: str, value) -> str:
    """The command-line form of a SpeculativeConfig setting."""
    if name == "adaptive":
        return "--speculative-adaptive" if value else "--no-speculative-adaptive"
    return f"--speculative-{name.replace('_', '-')} {value}"


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"  # local Hugging Face directory or preset name
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | dummy
    quantization: str | None = None  # dummy weights: fp8 | fp8-block | int4 | int4-experts (model/quant/)
    seed: int = 0  # dummy-weight seed and default sampling seed base
    tp_size: int = 1
    devices: list[int] | None = None  # CUDA device of each rank; repeats allowed (ranks share a GPU)
    allreduce: str = "auto"  # auto (measured per size) | fused | nccl
    allreduce_islands: str | None = None  # "0,1,2,3;4,5,6,7": rank islands (comm.islands checks them)
    max_running_requests: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_tokens_per_step: int = 2048  # prompt tokens a step carries beside its decodes (docs/PERF.md)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped by KV size
    block_size: int = 16
    mem_fraction_static: float = 0.85
    num_kv_blocks: int | None = None  # override the measured KV capacity
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_max_bs: int = 256
    # Other steps up to this many tokens replay piecewise graphs (0: none). Past about 450 tokens the
    # 8B model's GPU work outlasts its eager launches (docs/PERF.md, mixed steps on the H100).
    piecewise_graph_max_tokens: int = 512
    disable_overlap_schedule: bool = False  # TP=1 decode: prepare step N+1 while step N runs
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"--dtype {self.dtype!r} is not supported; choose auto, float32, bfloat16 or float16"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in (None, "fp8", "fp8-block", "int4", "int4-experts"):
            raise ValueError(
                f"--quantization must be fp8, fp8-block, int4 or int4-experts, got {self.quantization!r}"
            )
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.devices is not None and len(self.devices) != self.tp_size:
            raise ValueError(
                f"--devices lists {len(self.devices)} devices but --tp-size is {self.tp_size}; "
                "give one device per rank (repeats allowed)"
            )
        if self.devices is not None and self.device == "cpu":
            raise ValueError(
                f"--devices {','.join(map(str, self.devices))} places ranks on CUDA GPUs, but --device cpu "
                "runs them all on the CPU; drop --devices, or use --device cuda"
            )
        if self.allreduce not in ("auto", "fused", "nccl"):
            raise ValueError(f"--allreduce must be auto, fused or nccl, got {self.allreduce!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(
                f"--num-kv-blocks must be >= 1 (or left out: the KV capacity is measured), "
                f"got {self.num_kv_blocks}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_per_step < 1:
            raise ValueError(
                f"--max-prefill-tokens-per-step must be >= 1, got {self.max_prefill_tokens_per_step}"
            )
        if self.piecewise_graph_max_tokens < 0:
            raise ValueError(
                f"--piecewise-graph-max-tokens must be >= 0 (0: none), got {self.piecewise_graph_max_tokens}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must lie in (0, 1), got {self.mem_fraction_static}")
        if self.speculative.enabled and self.speculative.eagle_topk > 1:
            # Tree drafting moves the accepted path's KV into place at the start of the next step; a
            # sequence that finishes or is preempted first leaves blocks whose KV was never moved, so
            # they must not be shared through the prefix cache.
            self.enable_prefix_caching = False

    def resolved_device(self) -> str:
        """ "cuda" or "cpu". Raises ValueError for --device cuda where torch sees no CUDA GPU."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device cuda, but {why}; run with --device cpu (or auto)")
        if self.device != "auto":
            return self.device
        if torch.cuda.is_available():
            return "cuda"
        if self.devices is not None:
            raise ValueError(
                f"--devices {','.join(map(str, self.devices))} places ranks on CUDA GPUs, but none is "
                "visible, so --device auto runs on the CPU; drop --devices to run there"
            )
        return "cpu"


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model value
    cors_allow_origins: list[str] = field(default_factory=list)  # empty: no CORS headers
    restart_engine: bool = True  # restart a dead engine process; else the server exits non-zero
    engine_step_timeout: float = 120.0  # seconds without word from a busy engine: hung (0: never)
    shutdown_drain_timeout: float = 5.0  # seconds in-flight requests get to finish on SIGTERM

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must lie in [0, 65535], got {self.port}")
        if not self.engine_step_timeout >= 0:
            raise ValueError(f"--engine-step-timeout must be >= 0 (0: off), got {self.engine_step_timeout}")
        if not self.shutdown_drain_timeout >= 0:
            raise ValueError(f"--shutdown-drain-timeout must be >= 0, got {self.shutdown_drain_timeout}")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        ) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="local Hugging Face directory or preset name")
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default=d.dtype)
    g.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "fp8-block", "int4", "int4-experts"],
        help="random quantized weights for --load-format dummy or a preset (checkpoints: config.json's); "
        "int4-experts: INT4 group-32 MoE experts, linears bf16 (Kimi K2-Thinking's layout)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--tp-size", type=int, default=d.tp_size)
    g.add_argument("--devices", type=_int_list, default=None, help="CUDA device per rank, e.g. 0,0")
    g.add_argument("--allreduce", default=d.allreduce, choices=["auto", "fused", "nccl"])
    g.add_argument(
        "--allreduce-islands",
        default=None,
        help="TP rank islands for the hierarchical all-reduce, ';' between islands, e.g. '0,1,2,3;4,5,6,7' "
        "(default: derived from the PCIe/NUMA topology)",
    )
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument(
        "--max-prefill-tokens-per-step",
        type=int,
        default=d.max_prefill_tokens_per_step,
        help="prompt tokens (chunked prefill) one step may carry beside its decodes; bounds the gap "
        "between a stream's tokens while prompts arrive",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--disable-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs)
    g.add_argument(
        "--piecewise-graph-max-tokens",
        type=int,
        default=d.piecewise_graph_max_tokens,
        help="steps that are not plain decodes (prompt chunks, mixed prefill + decode) of up to this "
        "many tokens replay CUDA graphs split at attention, where start-up timing finds them faster; "
        "0 turns them off",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="run every step synchronously (by default, TP=1 decode steps launch the next step "
        "before reading this one's tokens)",
    )
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", default=None, choices=list(SPECULATIVE_ALGORITHMS))
    s.add_argument("--speculative-draft-model-path", default=None)
    s.add_argument("--speculative-num-steps", type=int, default=3)
    s.add_argument("--speculative-eagle-topk", type=int, default=1)
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    s.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="choose the number of draft tokens per step from measured costs (default on)",
    )
    s.add_argument(
        "--speculative-simulate-acceptance-length",
        type=float,
        default=None,
        help="benchmark only: accept drafts as if the mean acceptance length were this",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed flags: --X sets EngineConfig.X (--disable-prefix-caching clears
    enable_prefix_caching) and --speculative-X sets SpeculativeConfig.X."""
    spec = SpeculativeConfig(
        **{f.name: getattr(args, f"speculative_{f.name}") for f in fields(SpeculativeConfig)}
    )
    names = {f.name for f in fields(EngineConfig)} - {"speculative", "enable_prefix_caching"}
    kwargs = {n: getattr(args, n) for n in names}
    return EngineConfig(**kwargs, enable_prefix_caching=not args.disable_prefix_caching, speculative=spec)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=None, help="required on /v1/* and /metrics when set")
    g.add_argument("--served-model-name", default=None)
    g.add_argument(
        "--cors-allow-origins",
        type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
        default=[],
        help="comma-separated origins browsers may call from ('*' for any); default: no CORS",
    )
    g.add_argument(
        "--restart-engine",
        action=argparse.BooleanOptionalAction,
        default=d.restart_engine,
        help="restart the engine process when it dies (--no-restart-engine: exit non-zero instead)",
    )
    g.add_argument(
        "--engine-step-timeout",
        type=float,
        default=d.engine_step_timeout,
        help="seconds a busy engine may go without a word before it is killed as hung (0: never)",
    )
    g.add_argument(
        "--shutdown-drain-timeout",
        type=float,
        default=d.shutdown_drain_timeout,
        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they end with an error",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Every ServerConfig field from the add_server_args flag of the same name."""
    return ServerConfig(**{f.name: getattr(args, f.name) for f in fields(ServerConfig)})
