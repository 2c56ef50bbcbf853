"""CPU cost of turning `/v1/completions` responses with 8 top log-probs into `TurnRecord`s.

Run: `uv run python -m tools.bench.rollout_client [--repeats N]`. Inputs are real server responses
recorded by `record.py` (`responses.jsonl.gz`, about 350 bytes of JSON per generated token), plus a
"confident" copy of them in which a third of the log-probs are rewritten in exponent form
(`-1.2e-05`), as a trained model's near-certain tokens are, so the exponent path is timed too.

Side by side, per generated token, best of N runs over all responses:
- baseline: `json.loads` + one `{int(id): logprob}` dict per token (what a plain client does);
- agrpo: `decode_completion` (msgspec envelope + bulk numpy/SWAR decoding of `top_logprobs`, SPEC 12);
- agrpo-reference: `decode_completion(reference=True)`, the plain path the fast one is tested against.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import re
import time
from pathlib import Path

from agrpo_rollout import decode_completion

HERE = Path(__file__).resolve().parent
_VALUE = re.compile(rb"(?<=[\[:,])(-\d+\.\d+)(?=[,}\]])")


def load_responses() -> list[bytes]:
    return [line for line in gzip.decompress((HERE / "responses.jsonl.gz").read_bytes()).splitlines() if line]


def confident(raw: bytes) -> bytes:
    """Rewrite every third distinct sampled log-prob as `-d.ddde-0N`, wherever it occurs (sampled list
    and top entries stay consistent), as a trained model's near-certain tokens print."""
    sampled = raw.partition(b'"token_logprobs":')[2].partition(b'"tokens":')[0]
    values = sorted({m.group(1) for i, m in enumerate(_VALUE.finditer(sampled)) if i % 3 == 0})
    for value in values:
        raw = raw.replace(value, b"%.16ge-%02d" % (float(value), len(value) % 9 + 1))
    return raw


def baseline(raw: bytes) -> int:
    choice = json.loads(raw)["choices"][0]
    ids = choice["token_ids"]
    sampled = choice["logprobs"]["token_logprobs"]
    tops = [{int(k[9:]): v for k, v in top.items()} for top in choice["logprobs"]["top_logprobs"]]
    return len(ids) + len(sampled) + len(tops)


def agrpo(raw: bytes) -> int:
    return decode_completion(raw, [], 8).num_output_tokens


def agrpo_reference(raw: bytes) -> int:
    return decode_completion(raw, [], 8, reference=True).num_output_tokens


def us_per_token(fn, responses: list[bytes], repeats: int) -> float:
    tokens = sum(len(json.loads(r)["choices"][0]["token_ids"]) for r in responses)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for raw in responses:
            fn(raw)
        best = min(best, time.perf_counter() - start)
    return best / tokens * 1e6


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description="rollout client decode cost per generated token")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    recorded = load_responses()
    sets = {"recorded": recorded, "confident": [confident(r) for r in recorded]}
    size = sum(len(r) for r in recorded) / sum(
        len(json.loads(r)["choices"][0]["token_ids"]) for r in recorded
    )
    print(
        f"CPU: {_cpu()}; {len(recorded)} responses, {size:.0f} bytes of JSON per token, best of {args.repeats}"
    )
    print(
        f"{'inputs':<10} {'baseline us/tok':>16} {'agrpo us/tok':>13} {'reference us/tok':>17} {'speedup':>8}"
    )
    for name, responses in sets.items():
        base = us_per_token(baseline, responses, args.repeats)
        fast = us_per_token(agrpo, responses, args.repeats)
        ref = us_per_token(agrpo_reference, responses, max(3, args.repeats // 5))
        print(f"{name:<10} {base:>16.2f} {fast:>13.2f} {ref:>17.2f} {base / fast:>7.1f}x")


if __name__ == "__main__":
    main()
