"""Which algorithm carries a message of a given size: the per-bucket plan, and why.

A plan is a list of buckets per operation ("all_reduce" or "fused"), each covering messages up to
max_bytes, with the algorithm chosen for it ("one_shot", "two_shot" or "fallback") and the timings
that decided it. Messages larger than every bucket (or than the workspace) go to the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPS = ("all_reduce", "fused")
FALLBACK = "fallback"
# without measurements: one-shot while the bytes every rank pushes stay small, two-shot above
ONE_SHOT_PUSH_BYTES = 1 << 20


@dataclass
class Bucket:
    op: str
    max_bytes: int
    tokens: int  # the token count measured for this bucket (0: not measured)
    algorithm: str
    timings_us: dict[str, float] = field(default_factory=dict)
    reason: str = ""


@dataclass
class Plan:
    fallback_name: str  # "nccl", "gloo (CPU copies)", or "none"
    buckets: list[Bucket] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def choose(self, op: str, nbytes: int) -> str:
        """The algorithm for a message of nbytes; the fallback past the last bucket."""
        for bucket in self.buckets:
            if bucket.op == op and nbytes <= bucket.max_bytes:
                return bucket.algorithm
        return FALLBACK

    def describe(self) -> str:
        """One line per bucket: size, algorithm, timings and reason; then the notes."""
        lines = [f"fallback: {self.fallback_name}"]
        for b in self.buckets:
            timings = ", ".join(
                f"{k} {v:.1f} us" for k, v in sorted(b.timings_us.items(), key=lambda kv: kv[1])
            )
            size = f"<= {_human(b.max_bytes)}" + (f" ({b.tokens} tokens)" if b.tokens else "")
            lines.append(f"{b.op:10s} {size:24s} -> {b.algorithm:9s} {timings}  {b.reason}".rstrip())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "fallback": self.fallback_name,
            "buckets": [vars(b) for b in self.buckets],
            "notes": list(self.notes),
        }


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def bucket_tokens(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to max_tokens (max_tokens itself included)."""
    tokens, t = [], 1
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    return tokens + [max_tokens]


def default_algorithm(nbytes: int, world_size: int) -> str:
    """The unmeasured guess: one-shot while each rank pushes at most ONE_SHOT_PUSH_BYTES."""
    return "one_shot" if nbytes * (world_size - 1) <= ONE_SHOT_PUSH_BYTES else "two_shot"


def unmeasured_plan(
    fallback_name: str, world_size: int, row_bytes: int, max_tokens: int, reason: str, notes=()
) -> Plan:
    """Custom kernels for every bucket up to max_tokens rows, one-shot or two-shot by default_algorithm."""
    plan = Plan(fallback_name, notes=list(notes))
    for op in OPS:
        for t in bucket_tokens(max_tokens):
            nbytes = t * row_bytes
            plan.buckets.append(Bucket(op, nbytes, t, default_algorithm(nbytes, world_size), reason=reason))
    return plan


def decide(timings_us: dict[str, float]) -> tuple[str, str]:
    """Pick from measured times (already agreed by all ranks). The rule: the fastest custom algorithm,
    unless the fallback is at least as fast. Returns (algorithm, reason)."""
    custom = {k: v for k, v in timings_us.items() if k != FALLBACK}
    if not custom:
        return FALLBACK, "no custom algorithm measured"
    best = min(custom, key=custom.get)
    if FALLBACK in timings_us and timings_us[FALLBACK] <= custom[best]:
        return FALLBACK, f"{FALLBACK} is not slower than {best}"
    if FALLBACK in timings_us:
        return best, f"{timings_us[FALLBACK] / custom[best]:.2f}x faster than {FALLBACK}"
    return best, "fastest custom algorithm"
