"""What the HTTP server costs: decode throughput through `tpfuse serve` vs the same engine in-process.

For each concurrency c: c streamed requests (random prompt token ids, ignore_eos, min_tokens = max_tokens
= L: the body tpfuse bench sends) sent at once through the server, then the same workload (same
sampling parameters) on an LLMEngine in this process (after the server has
stopped, so both get the whole GPU). Reports output tok/s of both, their ratio, and TTFT / inter-token
latency seen by the HTTP client. The server's goal: ratio >= 0.97 at every concurrency (HTTP,
tokenization and detokenization never stall the engine loop).

Where a loss goes: "decode ratio" compares the per-stream decode rate after the first token (so it
leaves out TTFT, which a short run's wall time includes: request set-up, tokenization, prefill);
"step ms" is the engine process's mean engine.step() under the server, beside the in-process one;
"outside us" is its mean time per step outside engine.step() (pipe, outputs, stats), from the
loop_* counters in /metrics. A gap in step ms points at the engine process itself; a gap in the
decode ratio with equal step ms points at the HTTP side (SSE, detokenization, the event loop).

GPU: python benchmarks/server_overhead.py --model llama-3.1-8b --load-format dummy
CPU smoke: python benchmarks/server_overhead.py --device cpu --model tiny --concurrency 1,4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


async def _http_batch(url: str, model: str, prompts, max_tokens: int) -> dict:
    import ssl

    import httpx

    ssl_context = ssl.create_default_context()  # shared; one client per stream (see bench/client.py)

    async def one(prompt):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,  # as tpfuse bench sends it (nothing to ban with ignore_eos)
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        start = time.perf_counter()
        arrivals, tokens = [], 0  # arrival times of chunks that brought tokens
        async with (
            httpx.AsyncClient(base_url=url, timeout=3600, verify=ssl_context) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                count = json.loads(line[6:])["usage"]["completion_tokens"]
                if count > tokens:
                    arrivals.append(time.perf_counter())
                    tokens = count
        ttft = arrivals[0] - start
        itl = (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1)
        return ttft, itl, tokens

    before = loop_counters(url)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    after = loop_counters(url)
    tokens = sum(r[2] for r in results)
    steps = max(after["steps"] - before["steps"], 1)
    return {
        "tok_s": tokens / wall,
        "decode_tok_s": statistics.median([1.0 / r[1] for r in results if r[1] > 0] or [float("nan")]),
        "ttft_p50_ms": 1e3 * statistics.median(r[0] for r in results),
        "itl_p50_ms": 1e3 * statistics.median(r[1] for r in results),
        "step_ms": 1e3 * (after["step_s"] - before["step_s"]) / steps,
        "outside_us": 1e6 * (after["outside_s"] - before["outside_s"]) / steps,
        "tokens": tokens,
    }


def loop_counters(url: str) -> dict:
    """The engine loop's cumulative counters from /metrics (stats are sent every 0.25 s and on idle)."""
    import httpx

    time.sleep(0.35)
    names = {
        "tpfuse_engine_loop_steps_total": "steps",
        "tpfuse_engine_loop_step_seconds_total": "step_s",
        "tpfuse_engine_loop_outside_step_seconds_total": "outside_s",
    }
    values = {v: 0.0 for v in names.values()}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[names[name]] = float(value)
    return values


def _engine_batch(engine, prompts, max_tokens: int, tag: str) -> dict:
    from tpfuse.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    tokens, steps, step_s = 0, 0, 0.0
    first, last, count = {}, {}, {}
    while engine.has_unfinished():
        began = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps, step_s = steps + 1, step_s + now - began
        for o in outputs:
            tokens += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    wall = time.perf_counter() - start
    decode = [(count[r] - 1) / (last[r] - first[r]) for r in count if last[r] > first[r]]
    return {
        "tok_s": tokens / wall,
        "decode_tok_s": statistics.median(decode) if decode else float("nan"),
        "step_ms": 1e3 * step_s / max(steps, 1),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,16,64,128")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--server-args", default="", help="extra serve flags, e.g. '--tp-size 2'")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engine_flags = ["--model", args.model, "--load-format", args.load_format, "--device", args.device]
    engine_flags += args.server_args.split()

    from tpfuse.server.launcher import ServerSubprocess

    http = {}
    with ServerSubprocess(engine_flags, start_timeout=900) as server:
        asyncio.run(_http_batch(server.url, args.model, _prompts(2, args.prompt_len, 0), 8))  # warm-up
        for c in levels:
            http[c] = asyncio.run(
                _http_batch(server.url, args.model, _prompts(c, args.prompt_len, c), args.max_tokens)
            )
            print(f"http c={c}: {http[c]}", flush=True)

    from tpfuse.config import EngineConfig, add_engine_args, engine_config_from_args
    from tpfuse.engine.engine import LLMEngine

    p = argparse.ArgumentParser()
    add_engine_args(p)
    config: EngineConfig = engine_config_from_args(p.parse_args(engine_flags))
    engine = LLMEngine(config)
    _engine_batch(engine, _prompts(2, args.prompt_len, 0), 8, "warmup")
    rows = []
    for c in levels:
        local = _engine_batch(engine, _prompts(c, args.prompt_len, 1000 + c), args.max_tokens, f"c{c}")
        rows.append(
            {
                "concurrency": c,
                "http": http[c],
                "in_process": local,
                "ratio": http[c]["tok_s"] / local["tok_s"],
                "decode_ratio": http[c]["decode_tok_s"] / local["decode_tok_s"],
            }
        )
    engine.shutdown()

    print(
        f"\nserver overhead: {args.model} ({args.load_format}) on {args.device}, prompt {args.prompt_len}, "
        f"{args.max_tokens} tokens, ignore_eos, greedy"
    )
    print(
        f"{'conc':>5} {'http tok/s':>11} {'engine tok/s':>13} {'ratio':>6} {'decode ratio':>13} "
        f"{'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'step ms srv/eng':>16} {'outside us':>11}"
    )
    for r in rows:
        h, e = r["http"], r["in_process"]
        print(
            f"{r['concurrency']:>5} {h['tok_s']:>11.1f} {e['tok_s']:>13.1f} {r['ratio']:>6.3f} "
            f"{r['decode_ratio']:>13.3f} {h['ttft_p50_ms']:>12.1f} {h['itl_p50_ms']:>11.2f} "
            f"{h['step_ms']:>7.3f}/{e['step_ms']:<8.3f} {h['outside_us']:>11.1f}"
        )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "server_overhead.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
