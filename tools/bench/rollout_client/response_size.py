"""Where the bulk top-log-prob decoder starts to win: cost per response by size, bulk vs `json.loads`.

Run: `uv run python -m tools.bench.rollout_client.response_size [--repeats N]`. Inputs: the longest
recorded response (`responses.jsonl.gz`, real CPU-server bytes) cut to its first n tokens and written
back as vLLM writes it (`json.dumps`, compact separators), n from 1 to 512, with 8 top log-probs per
token. Side by side, best of N, microseconds per response, all through `decode_completion`:
- bulk: the numpy/SWAR decoder of `_top_logprobs_json.py` at every size (`SMALL_TOP_LOGPROBS_BYTES=0`);
- json: `json.loads` of the `top_logprobs` array alone, msgspec for the envelope (threshold off);
- reference: `json.loads` of the whole body (`reference=True`), the plain path of a plain client;
- auto: what `decode_completion` does with the current `SMALL_TOP_LOGPROBS_BYTES`.
The threshold is set where bulk starts to beat json. Responses without top log-probs (`logprobs: 0`)
never reach either (msgspec decodes their envelope and skips the array), so they are not timed here.
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

from agrpo_rollout import _completion_response, decode_completion
from tools.bench.rollout_client.__main__ import _cpu, load_responses

SIZES = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64, 128, 256, 512)


def truncated(raw: bytes, num_tokens: int) -> bytes:
    """The response cut to its first `num_tokens` tokens."""
    body = json.loads(raw)
    choice = body["choices"][0]
    choice["token_ids"] = choice["token_ids"][:num_tokens]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        choice["logprobs"][key] = choice["logprobs"][key][:num_tokens]
    body["usage"]["completion_tokens"] = len(choice["token_ids"])
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def array_bytes(raw: bytes) -> int:
    lo = raw.find(b'"top_logprobs":[') + len(b'"top_logprobs":')
    return raw.find(b"]", lo) - lo + 1


def best_us(fn, raw: bytes, repeats: int, threshold: int | None) -> float:
    inner = max(5, 20_000 // max(len(raw) // 100, 1))
    value = _completion_response.SMALL_TOP_LOGPROBS_BYTES if threshold is None else threshold
    best = float("inf")
    with mock.patch.object(_completion_response, "SMALL_TOP_LOGPROBS_BYTES", value):
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn(raw)
            best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description="decode cost per response by size: bulk vs json.loads")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    longest = max(load_responses(), key=len)
    print(
        f"CPU: {_cpu()}; best of {args.repeats}; "
        f"SMALL_TOP_LOGPROBS_BYTES = {_completion_response.SMALL_TOP_LOGPROBS_BYTES}"
    )
    print(
        f"{'tokens':>6} {'array B':>8} {'bulk us':>8} {'json us':>8} {'ref us':>8} {'auto us':>8} {'json/bulk':>9}"
    )
    fast = lambda r: decode_completion(r, [], 8)  # noqa: E731
    reference = lambda r: decode_completion(r, [], 8, reference=True)  # noqa: E731
    for num_tokens in SIZES:
        raw = truncated(longest, num_tokens)
        bulk = best_us(fast, raw, args.repeats, 0)
        loads = best_us(fast, raw, args.repeats, 1 << 40)
        ref = best_us(reference, raw, args.repeats, None)
        auto = best_us(fast, raw, args.repeats, None)
        print(
            f"{num_tokens:>6} {array_bytes(raw):>8} {bulk:>8.1f} {loads:>8.1f} {ref:>8.1f} {auto:>8.1f} "
            f"{loads / bulk:>8.2f}x"
        )


if __name__ == "__main__":
    main()
