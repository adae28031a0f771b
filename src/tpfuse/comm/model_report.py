"""`tpfuse comm-model`: the cost model's table for one topology (text, markdown for docs, JSON), the
crossovers, and the per-decode-step gain of the fused path."""

from __future__ import annotations

from tpfuse.comm.cost_model import SCHEDULE_ORDER, TopologyModel, crossover_bytes, predict

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def model_json(t: TopologyModel, rows=DEFAULT_ROWS, hidden: int = 6144, layers: int = 61,
               all_reduces_per_layer: int = 2) -> dict:  # fmt: skip
    """Everything comm-model prints, as one JSON-able dict."""
    table = predict(t, list(rows), hidden)
    per_step = layers * all_reduces_per_layer
    crossovers = {
        "one_shot->two_shot": crossover_bytes(t, "one_shot", "two_shot"),
        "one_shot->nccl": crossover_bytes(t, "one_shot", "nccl"),
    }
    for row in table:
        row["fused_gain_per_step_us"] = round(row["fused_gain_us"] * per_step, 1)
    return {
        "topology": t.to_json(),
        "hidden": hidden,
        "dtype_bytes": 2,
        "decode_step": {"layers": layers, "all_reduces_per_layer": all_reduces_per_layer},
        "rows": table,
        "crossover_bytes": crossovers,
        "note": "a model, not a measurement: the start-up race against NCCL decides",
    }


def _columns(table: list[dict]) -> list[str]:
    present = [s for s in SCHEDULE_ORDER if s in table[0]]
    return ["rows", "bytes", *present, "nccl_ring", "nccl_tree", "best_fused", "fused_gain_us",
            "fused_gain_per_step_us"]  # fmt: skip


def markdown_table(report: dict) -> str:
    """The rows as a markdown table (the form docs/PCIE.md keeps; a CPU test regenerates it)."""
    cols = _columns(report["rows"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in report["rows"]]
    return "\n".join(lines)


def format_text(report: dict) -> str:
    t = report["topology"]
    step = report["decode_step"]
    cols = _columns(report["rows"])
    widths = [max(len(c), *(len(str(r[c])) for r in report["rows"])) for c in cols]
    lines = [
        f"cost model: {t['name']} ({t['description']})",
        f"hidden {report['hidden']}, bf16; microseconds per all-reduce; {report['note']}",
        "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)),
    ]
    lines += [
        "  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)) for r in report["rows"]
    ]
    for pair, nbytes in report["crossover_bytes"].items():
        lines.append(f"crossover {pair}: " + (f"{nbytes / 1024:.1f} KiB" if nbytes else "none below 64 MiB"))
    lines.append(
        f"fused_gain_us: NCCL + the norm kernel minus the best fused schedule; per step: x "
        f"{step['layers']} layers x {step['all_reduces_per_layer']} all-reduces"
    )
    return "\n".join(lines)
