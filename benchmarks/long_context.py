"""Long-context serving: TTFT and decode speed of one stream at 32k and 128k prompt tokens.

Starts `tpfuse serve` (llama-3.1-8b preset, dummy weights by default), warms it up with a short
request, then for each prompt length sends one streamed completion of fresh random token ids (no
prefix-cache hits) with ignore_eos, and reports TTFT (request sent to first token, the chunked
prefill of the whole prompt), the prefill rate that implies, and the decode rate after the first
token (each decode step reads the whole context's KV besides the weights).

GPU: python benchmarks/long_context.py                    (32000 and 128000 tokens, 256 new each)
     python benchmarks/long_context.py --lengths 32000 --server-args="--max-prefill-tokens-per-step 8192"
CPU smoke: python benchmarks/long_context.py --device cpu --model tiny --lengths 200,400 --new-tokens 8
Results: $OUT/long_context.json when OUT is set; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import time


def stream_one(url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    """One streamed completion; returns TTFT, decode tok/s after the first token and the usage."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "min_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    usage: dict = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            usage = event.get("usage") or usage
            count = usage.get("completion_tokens", 0)
            if event["choices"] and count > (arrivals[-1][1] if arrivals else 0):
                arrivals.append((time.perf_counter(), count))
    if usage.get("completion_tokens") != new_tokens or usage.get("prompt_tokens") != len(prompt):
        raise RuntimeError(f"expected {len(prompt)} prompt and {new_tokens} new tokens, got usage {usage}")
    (first, first_count), (last, last_count) = arrivals[0], arrivals[-1]
    decode = (last_count - first_count) / (last - first) if last > first else float("nan")
    return {"ttft_s": first - started, "decode_tok_s": decode, "usage": usage}


def _vocab_size(model: str) -> int:
    from tpfuse.model.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model]["vocab_size"]
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="32000,128000", help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--server-args", default="", help="extra `tpfuse serve` flags")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args()
    from tpfuse.server.launcher import ServerSubprocess

    vocab = _vocab_size(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    flags = ["--device", args.device, "--model", args.model, "--load-format", args.load_format]
    flags += shlex.split(args.server_args)
    rows = []
    with ServerSubprocess(flags, start_timeout=args.start_timeout) as server:
        rng = random.Random(0)
        stream_one(server.url, args.model, [rng.randrange(vocab // 2, vocab) for _ in range(64)], 8)
        for length in lengths:
            prompt = [rng.randrange(vocab // 2, vocab) for _ in range(length)]
            row = {"prompt_tokens": length, **stream_one(server.url, args.model, prompt, args.new_tokens)}
            row["prefill_tok_s"] = length / row["ttft_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nlong context: {args.model} ({args.load_format}) on {args.device}, {args.new_tokens} new tokens")
    print(f"{'prompt tokens':>13} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r in rows:
        rates = f"{r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f}"
        print(f"{r['prompt_tokens']:>13} {r['ttft_s']:>8.2f} {rates}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "long_context.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
