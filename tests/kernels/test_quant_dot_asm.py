"""The integer tensor-core tiles compile (real compiler, sm_90) to code that copies each packed word
once: no 4-byte cp.async per code lane, no more bytes staged per thread than the FP8 tile of the same
shape (whose e4m3 weights are twice the bytes of 4-bit codes), and no spills. The FP8 W8A8 decode
tiles run the e4m3 MMA on weights as loaded: no conversion instruction, no spills."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tpfuse.kernels.quant_fp8_w8a8 import W8A8_TILES

SCRIPT = Path(__file__).with_name("quant_dot_asm.py")


def _copied_bytes(row: dict) -> int:
    return sum(int(re.search(r"(\d+) B", k).group(1)) * v for k, v in row.items() if k.startswith("cp.async"))


def _compiled(*flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = SCRIPT.parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_int4_tensor_core_tiles_copy_each_word_once_without_spills():
    rows = _compiled()
    fp8 = {row["tile"]: row for row in rows if row["weights"] == "fp8"}
    ints = [row for row in rows if row["weights"] == "int4"]
    assert ints and len(ints) == len(fp8)
    for row in ints:
        assert row["cp.async 4 B"] == 0, row
        assert _copied_bytes(row) <= _copied_bytes(fp8[row["tile"]]), (row, fp8[row["tile"]])
        assert row["local"] == 0 and row["wgmma"] > 0 and row["mma.sync"] == 0, row
        assert row["stack"] == 0 and row["LDL"] == 0 and row["STL"] == 0, row


def test_fp8_w8a8_decode_tiles_run_the_e4m3_mma_on_unconverted_weights_without_spills():
    rows = _compiled("--w8a8")
    assert len(rows) == 2 * len({t for ts in W8A8_TILES.values() for t in ts})
    for row in rows:
        if "QGMMA" not in row:  # no cuobjdump in this Triton wheel: nothing to read
            continue
        assert row["QGMMA"] > 0 and row["HGMMA"] == 0, row
        assert row["weight_conversions"] == 0, row
        assert row["stack"] == 0 and row["LDL"] == 0 and row["STL"] == 0, row
