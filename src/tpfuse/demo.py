"""`tpfuse demo`: start the server on the embedded model, send requests with the OpenAI client, stop it.

Everything runs offline on a CPU: the default model is the `tiny` preset (random weights and a
byte-level tokenizer, so its text is noise; the point is the machinery). It ends with a short
`tpfuse bench single` and a small `tpfuse bench sweep` against the same server, printing both tables.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="serve the embedded model and send it a few OpenAI-client requests",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="tiny", help="preset name or local Hugging Face directory")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per demo request")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--no-bench", action="store_true", help="skip the closing benchmark")
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from tpfuse.server.launcher import ServerSubprocess

    if args.max_tokens < 1:
        print(f"tpfuse demo: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    server_args = ["--model", args.model, "--device", args.device]
    print(f"starting: tpfuse serve {' '.join(server_args)} ...", flush=True)
    started = time.perf_counter()
    try:
        with ServerSubprocess(server_args, start_timeout=args.startup_timeout) as server:
            print(f"server ready at {server.url} after {time.perf_counter() - started:.1f} s\n", flush=True)
            show_requests(server.url, args.model, args.max_tokens)
            if not args.no_bench:
                show_benchmarks(server.url, args.max_tokens)
            print("\nstopping the server ...", flush=True)
    except RuntimeError as exc:
        print(f"tpfuse demo: {exc}", file=sys.stderr)
        return 1
    print("server stopped")
    return 0


def show_requests(base_url: str, model: str, max_tokens: int) -> None:
    """A completion, a chat, a streamed chat and a burst of concurrent requests, printed as they go."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="tpfuse-demo", max_retries=0, timeout=600)
    if model == "tiny":
        print("(the tiny model has random weights: expect noise, not prose)\n")

    prompt = "The capital of France is"
    result = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    _print_result("completion", prompt, result.choices[0].text, result.choices[0].finish_reason, result.usage)

    messages = [{"role": "user", "content": "Say hello in three languages."}]
    result = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    _print_result(
        "chat",
        messages[0]["content"],
        result.choices[0].message.content,
        result.choices[0].finish_reason,
        result.usage,
    )

    print("== streamed chat ==")
    print(f"user: {messages[0]['content']}\nassistant: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.8,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n[usage] {chunk.usage.completion_tokens} tokens\n")

    asyncio.run(_burst(base_url, model, max_tokens, num_requests=8))


def show_benchmarks(base_url: str, max_tokens: int) -> None:
    """`tpfuse bench single` (1 warm-up, 3 runs) and `tpfuse bench sweep` (concurrency 1, 2, 4), short."""
    from tpfuse.bench import (
        BenchOptions,
        ClientConfig,
        SingleConfig,
        SweepConfig,
        print_single,
        print_sweep,
        run_single,
        run_sweep,
    )

    # Token counts come from the server's usage. The tiny model emits random bytes that do not
    # re-tokenize to the same count, so the client-side recount is off here.
    options = BenchOptions(ClientConfig(url=base_url), tokenizer="none")
    print("== tpfuse bench single (1 warm-up, 3 runs) ==", flush=True)
    print_single(run_single(options, SingleConfig(warmups=1, runs=3, max_tokens=4 * max_tokens)))
    print("== tpfuse bench sweep (concurrency 1, 2, 4) ==", flush=True)
    sweep = SweepConfig(concurrencies=(1, 2, 4), repeats=1, max_tokens=max_tokens, requests_per_level=8)
    print_sweep(run_sweep(options, sweep))


async def _burst(base_url: str, model: str, max_tokens: int, num_requests: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="tpfuse-demo", max_retries=0, timeout=600)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.completions.create(
                model=model,
                prompt=f"Request {i}:",
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for i in range(num_requests)
        )
    )
    elapsed = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens for r in results)
    print(f"== {num_requests} concurrent completions ==")
    print(f"{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s (batched by the engine)")
    await client.close()


def _print_result(title: str, prompt: str, text: str, finish_reason: str, usage) -> None:
    print(f"== {title} ==")
    print(f"prompt: {prompt}")
    print(f"output: {text!r}")
    print(
        f"finish_reason={finish_reason}  prompt_tokens={usage.prompt_tokens}  "
        f"completion_tokens={usage.completion_tokens}\n"
    )
