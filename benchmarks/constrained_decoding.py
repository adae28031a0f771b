"""What logits processing costs: decode tok/s of plain greedy requests against the same requests with
a json_schema grammar, with logprobs, and with penalties, on an in-process engine (so the figure is
the engine's, not HTTP's). Target (issue 24): json_schema within 10 % of plain at concurrency 1 and 64.
`--variants sampled` adds temperature 0.8 / top_p 0.95 rows (no processing: the sampler's own path).

Random weights write long strings inside the schema's string field, so every request decodes its
max_tokens (ignore_eos keeps a finished grammar sampling EOS, which the mask then allows alone).

GPU: python benchmarks/constrained_decoding.py --model llama-3.1-8b --load-format dummy
CPU smoke: python benchmarks/constrained_decoding.py --device cpu --model tiny --concurrency 1,2 \
    --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _run(engine, concurrency: int, max_tokens: int, extra: dict, tag: str) -> float:
    from tpfuse.engine.sampling_params import SamplingParams

    rng = random.Random(concurrency)
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **extra})
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", [rng.randrange(32, 127) for _ in range(64)], params)
    first_token_at = None
    tokens = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if outputs and first_token_at is None:
            first_token_at = now  # the prefill step: leave it out of the decode rate
            continue
        tokens += sum(len(o.new_token_ids) for o in outputs)
    return tokens / (time.perf_counter() - first_token_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--variants", default="plain,json_schema,logprobs=5,penalties", help="comma list")
    args = parser.parse_args()

    from tpfuse.config import EngineConfig
    from tpfuse.engine.engine import LLMEngine
    from tpfuse.engine.sampling_params import Grammar

    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, device=args.device))
    variants = {
        "plain": {},
        "json_schema": {"grammar": Grammar("json_schema", json.dumps(SCHEMA))},
        "logprobs=5": {"logprobs": 5},
        "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
        "sampled": {"temperature": 0.8, "top_p": 0.95, "seed": 1},  # no processing: the sampler's path
    }
    variants = {name: variants[name] for name in ["plain", *args.variants.split(",")] if name in variants}
    for params in variants.values():  # every path compiled (grammar machinery, sampler) before timing
        _run(engine, 2, 8, params, "warmup")
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        rates = {
            name: _run(engine, c, args.max_tokens, extra, f"{name}-{c}") for name, extra in variants.items()
        }
        rows.append({"concurrency": c, **rates})
    engine.shutdown()
    print(
        f"\nlogits processing cost: {args.model} ({args.load_format}) on {args.device}, "
        f"{args.max_tokens} tokens"
    )
    print(f"{'conc':>5} " + " ".join(f"{name + ' tok/s':>17} {'ratio':>6}" for name in variants))
    for r in rows:
        cells = [f"{r[name]:>17.1f} {r[name] / r['plain']:>6.3f}" for name in variants]
        print(f"{r['concurrency']:>5} " + " ".join(cells))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "constrained_decoding.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
