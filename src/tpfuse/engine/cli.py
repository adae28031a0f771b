"""`tpfuse generate`: offline generation from the command line.

Plain output: each completion's text on stdout, one line per prompt (a newline or carriage return
inside a completion is written as the two characters \\n or \\r; `--json` keeps the exact text);
`--json`: one JSON object per prompt per line. Logs (load time, tokens/s, speculative acceptance) go
to stderr. With --speculative-simulate-acceptance-length the logs carry a warning and every JSON
record has "simulated_acceptance": true: those tokens are not the model's output.
Errors print one line on stderr, without a traceback, and exit 2 for flags that do not fit together
(as argparse does for malformed ones) or 1 for anything later (a bad checkpoint, a request too long).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(subparsers) -> None:
    from tpfuse.config import add_engine_args

    parser = subparsers.add_parser(
        "generate",
        help="offline generation",
        description="Generate completions for one or more prompts and print them.",
    )
    parser.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    parser.add_argument(
        "--chat", action="store_true", help="each prompt as a user message, through the model's chat template"
    )
    add_engine_args(parser)
    parser.set_defaults(handler=run_generate)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_generate(args: argparse.Namespace) -> int:
    from tpfuse.config import engine_config_from_args
    from tpfuse.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            seed=args.seed if args.temperature > 0 else None,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        config = engine_config_from_args(args)
    except ValueError as exc:  # the flags themselves
        return _error(exc, 2)
    try:
        return _generate(args, params, config)
    except Exception as exc:
        return _error(exc, 1)


def _error(exc: Exception, code: int) -> int:
    """One line, no traceback: the message names the problem and the fix."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, ValueError | RuntimeError | OSError):
        message = f"{type(exc).__name__}: {message}"
    print(f"tpfuse generate: error: {message}", file=sys.stderr)
    return code


def _generate(args: argparse.Namespace, params, config) -> int:
    from tpfuse.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM.from_config(config)
    loaded = time.perf_counter()
    # Logged only after success, so a failure leaves exactly one line (the error) on stderr.
    load_log = (
        f"loaded {config.model} in {loaded - start:.1f} s: {llm.engine.stats().num_kv_blocks} KV blocks, "
        f"max_model_len {llm.engine.max_model_len}"
    )
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    elapsed = time.perf_counter() - loaded
    generated = sum(len(o.token_ids) for o in outputs)
    rate = generated / elapsed if elapsed > 0 else 0.0
    _log(load_log)
    _log(f"generated {generated} tokens for {len(outputs)} prompts in {elapsed:.2f} s: {rate:.1f} tok/s")
    simulated = config.speculative.simulate_acceptance_length is not None
    if config.speculative.enabled:
        stats = llm.engine.stats()
        _log(
            f"speculative ({config.speculative.algorithm}): mean acceptance length "
            f"{stats.spec_acceptance_length:.2f}, {stats.spec_num_accepted_tokens_total} of "
            f"{stats.spec_num_draft_tokens_total} drafts accepted"
        )
    if simulated:
        from tpfuse.spec.simulate import SIMULATED_ACCEPTANCE_NOTICE

        _log(f"WARNING: {SIMULATED_ACCEPTANCE_NOTICE}")
    for out in outputs:
        if args.json:
            record = {
                "text": out.text,
                "token_ids": out.token_ids,
                "prompt_token_ids": out.prompt_token_ids,
                "finish_reason": out.finish_reason,
            }
            if simulated:
                record["simulated_acceptance"] = True
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.text.replace("\n", "\\n").replace("\r", "\\r"))
    sys.stdout.flush()
    return 0
