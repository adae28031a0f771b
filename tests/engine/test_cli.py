"""`tpfuse generate` as a user runs it: a subprocess on the embedded tiny model."""

import json
import subprocess
import sys

import pytest

BASE = [sys.executable, "-m", "tpfuse", "generate", "--model", "tiny", "--device", "cpu"]
BASE += ["--num-kv-blocks", "64"]


def run(*args, timeout=120):
    return subprocess.run([*BASE, *args], capture_output=True, text=True, timeout=timeout)


def test_plain_output_prints_one_line_per_prompt_and_logs_tokens_per_second_on_stderr():
    proc = run("--prompt", "hello", "--prompt", "a second prompt", "--max-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2
    assert "tok/s" in proc.stderr


def test_json_output_has_one_object_per_prompt_with_ids_text_and_finish_reason():
    proc = run(
        "--prompt", "hello", "--prompt", "xy", "--max-tokens", "5", "--temperature", "0.7", "--seed", "3",
        "--top-p", "0.9", "--top-k", "40", "--ignore-eos", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 2
    from tpfuse.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    for record, prompt in zip(records, ["hello", "xy"], strict=True):
        assert record["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(record["token_ids"]) == 5 and record["finish_reason"] == "length"
        assert record["text"] == tokenizer.decode(record["token_ids"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "/no/such/model"),
        (["--max-tokens", "100000"], "max_model_len"),
    ],
)
def test_errors_print_one_line_on_stderr_and_exit_nonzero_without_traceback(args, message):
    proc = run("--prompt", "hi", *args)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and message in lines[0]
