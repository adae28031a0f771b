"""What the server path costs per token, measured on the CPU with no model behind it.

A stand-in engine (CadenceEngine) takes `--cadence-us` per step (a sleep: a synchronous device step
of that length; 0 emits as fast as the loop turns) and emits one token per running request per
step, recording when each token left engine.step(). It runs behind the real server path: the engine
process loop and its pipe, the HTTP process's reader thread and event loop, Generation and its
Detokenizer, SSE encoding and uvicorn. A streaming client (the body tpfuse bench sends: ignore_eos,
min_tokens = max_tokens, usage in every chunk) records when each token arrived. Per cadence it
reports:
  srv tok/s / eng tok/s  per-stream rate through the server vs the same stand-in stepped in-process;
  outside us             the engine loop's mean time per step outside engine.step() (loop_* stats);
  CPU us/tok http/eng    CPU time (user + system) per token of the HTTP and the engine process;
  switches/tok           their context switches (every thread's) per token: the wake-ups a token
                         costs, which is what a per-token cost on a VM's CPUs mostly is;
  added p50 / p99 us     the arrival time of each token at the client minus when it left step();
  tok/chunk              tokens per SSE chunk (outputs that queued up are merged into one chunk).

CPU: PYTHONPATH=src python -m benchmarks.server_path --cadence-us 4000,0 --tokens 2000
(run from the repository root; `-m` so the engine process can import the stand-in.)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time

TOKEN_IDS = [ord(c) for c in "the quick brown fox jumps over a lazy dog "]


class CadenceEngine:
    """LLMEngine's interface (add_request, abort_request, has_unfinished, step, stats, shutdown) with a
    step of `cadence_s` and one token per running request per step; on finishing a request it writes
    the perf_counter() times its tokens left step() to emit_dir/<request_id>.json (perf_counter is
    the system-wide monotonic clock on Linux, so the client can compare)."""

    def __init__(self, config, cadence_s: float, emit_dir: str | None):
        from tpfuse.model.tokenizer import ByteTokenizer

        self.config = config
        self.cadence_s = cadence_s
        self.emit_dir = emit_dir
        self.tokenizer = ByteTokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = 1 << 20
        self.requests: dict[str, dict] = {}
        self.generated = 0

    def add_request(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = {
            "prompt": len(prompt_token_ids),
            "max_tokens": params.max_tokens,
            "times": [],
        }

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        from tpfuse.engine.engine import StepOutput

        if self.cadence_s > 0:
            time.sleep(self.cadence_s)
        outputs = []
        now = time.perf_counter()
        for request_id, req in list(self.requests.items()):
            times = req["times"]
            times.append(now)
            done = len(times) >= req["max_tokens"]
            token = TOKEN_IDS[len(times) % len(TOKEN_IDS)]
            outputs.append(
                StepOutput(request_id, [token], done, "length" if done else None, req["prompt"], 0)
            )
            if done:
                del self.requests[request_id]
                self._write_times(request_id, times)
        self.generated += len(outputs)
        return outputs

    def _write_times(self, request_id: str, times: list[float]) -> None:
        if self.emit_dir is not None:
            with open(os.path.join(self.emit_dir, f"{request_id}.json"), "w") as f:
                json.dump(times, f)

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "num_generated_tokens": self.generated}

    def shutdown(self):
        pass


def make_cadence_engine(config, cadence_s: float, emit_dir: str | None):
    return CadenceEngine(config, cadence_s, emit_dir)


def _serve(argv: list[str]) -> int:
    """The server process: `tpfuse serve` flags plus --cadence-us and --emit-dir."""
    from benchmarks.server_path import make_cadence_engine as factory  # importable in the engine process

    from tpfuse.config import (
        add_engine_args,
        add_server_args,
        engine_config_from_args,
        server_config_from_args,
    )
    from tpfuse.server.cli import run_server

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    parser.add_argument("--cadence-us", type=float, required=True)
    parser.add_argument("--emit-dir", required=True)
    args = parser.parse_args(argv)
    engine = functools.partial(factory, cadence_s=args.cadence_us * 1e-6, emit_dir=args.emit_dir)
    return run_server(engine_config_from_args(args), server_config_from_args(args), engine)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _context_switches(pid: int) -> int:
    """Voluntary + involuntary context switches of every thread of a process (its wake-ups)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def _engine_pid(http_pid: int) -> int:
    """The engine process: the HTTP process's child."""
    for task in os.listdir(f"/proc/{http_pid}/task"):
        with open(f"/proc/{http_pid}/task/{task}/children") as f:
            children = f.read().split()
        if children:
            return int(children[-1])
    raise RuntimeError(f"process {http_pid} has no engine process")


async def _stream(url: str, max_tokens: int) -> tuple[str, list[tuple[float, int]]]:
    """One streamed completion; returns its id and (arrival time, cumulative tokens) per chunk."""
    import httpx

    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    arrivals: list[tuple[float, int]] = []
    response_id = ""
    async with (
        httpx.AsyncClient(base_url=url, timeout=600) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        response.raise_for_status()
        pending = b""
        async for piece in response.aiter_bytes():
            now = time.perf_counter()
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                response_id = event["id"]
                count = event["usage"]["completion_tokens"]
                if event["choices"] and count > (arrivals[-1][1] if arrivals else 0):
                    arrivals.append((now, count))
    return response_id, arrivals


def _measure_server(cadence_us: float, tokens: int, concurrency: int) -> dict:
    from benchmarks.server_overhead import loop_counters

    from tpfuse.server.launcher import ServerSubprocess

    emit_dir = tempfile.mkdtemp(prefix="server-path-")
    flags = ["--serve", "--device", "cpu", "--model", "tiny"]
    flags += ["--cadence-us", str(cadence_us), "--emit-dir", emit_dir]
    with ServerSubprocess(flags, module="benchmarks.server_path", start_timeout=120) as server:

        async def run(n: int, length: int):
            return await asyncio.gather(*(_stream(server.url, length) for _ in range(n)))

        asyncio.run(run(1, 32))  # warm-up
        pids = {"http": server.proc.pid, "engine": _engine_pid(server.proc.pid)}
        before = loop_counters(server.url)
        usage = {name: (_cpu_seconds(pid), _context_switches(pid)) for name, pid in pids.items()}
        started = time.perf_counter()
        results = asyncio.run(run(concurrency, tokens))
        wall = time.perf_counter() - started
        for name, pid in pids.items():
            usage[name] = (_cpu_seconds(pid) - usage[name][0], _context_switches(pid) - usage[name][1])
        after = loop_counters(server.url)
    added, per_stream, chunks = [], [], 0
    for response_id, arrivals in results:
        with open(os.path.join(emit_dir, f"{response_id}-0.json")) as f:
            emitted = json.load(f)
        chunks += len(arrivals)
        previous = 0
        for arrival, count in arrivals:
            added += [arrival - emitted[i] for i in range(previous, count)]
            previous = count
        first, last = arrivals[0], arrivals[-1]
        per_stream.append((last[1] - first[1]) / (last[0] - first[0]))
    total = sum(a[-1][1] for _, a in results)
    added.sort()
    steps = max(after["steps"] - before["steps"], 1)
    return {
        "tok_s": statistics.median(per_stream),
        "outside_us": 1e6 * (after["outside_s"] - before["outside_s"]) / steps,
        "http_cpu_us_per_token": 1e6 * usage["http"][0] / total,
        "engine_cpu_us_per_token": 1e6 * usage["engine"][0] / total,
        "http_switches_per_token": usage["http"][1] / total,
        "engine_switches_per_token": usage["engine"][1] / total,
        "added_p50_us": 1e6 * added[len(added) // 2],
        "added_p99_us": 1e6 * added[int(len(added) * 0.99)],
        "tokens_per_chunk": total / chunks,
        "wall_s": wall,
    }


def _measure_in_process(cadence_us: float, tokens: int, concurrency: int) -> float:
    """The stand-in stepped in this process: its per-stream tok/s (the sleep's overshoot included)."""
    from tpfuse.engine.sampling_params import SamplingParams

    engine = CadenceEngine(None, cadence_us * 1e-6, None)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"r{i}", [1], params)
    started = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cadence-us", default="4000,0", help="step lengths to measure, comma-separated")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for cadence in (float(c) for c in args.cadence_us.split(",")):
        row = _measure_server(cadence, args.tokens, args.concurrency)
        row["cadence_us"] = cadence
        row["engine_tok_s"] = _measure_in_process(cadence, args.tokens, args.concurrency)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nserver path on the CPU: stand-in engine, {args.concurrency} stream(s) x {args.tokens} tokens")
    print(
        f"{'cadence us':>10} {'srv tok/s':>10} {'eng tok/s':>10} {'ratio':>6} {'outside us':>11} "
        f"{'CPU us/tok http/eng':>20} {'switches/tok http/eng':>22} {'added p50/p99 us':>17} "
        f"{'tok/chunk':>10}"
    )
    for r in rows:
        print(
            f"{r['cadence_us']:>10.0f} {r['tok_s']:>10.1f} {r['engine_tok_s']:>10.1f} "
            f"{r['tok_s'] / r['engine_tok_s']:>6.3f} {r['outside_us']:>11.1f} "
            f"{r['http_cpu_us_per_token']:>11.0f}/{r['engine_cpu_us_per_token']:<8.0f} "
            f"{r['http_switches_per_token']:>12.2f}/{r['engine_switches_per_token']:<9.2f} "
            f"{r['added_p50_us']:>8.0f}/{r['added_p99_us']:<8.0f} {r['tokens_per_chunk']:>10.2f}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(_serve(sys.argv[2:]))
    main()
