"""Record real `/v1/completions` responses with 8 top log-probs for the rollout-client benchmark.

Run once against a running server: `uv run python -m tools.bench.rollout_client.record --base-url URL
--model NAME`, or with no `--base-url` to start a CPU vLLM server on a tiny random model (about a
minute). Writes `responses.jsonl.gz` beside this file: one raw response body per line, exactly as the
server sent it (about 400 bytes of JSON per generated token), gzip-compressed.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
OUT = HERE / "responses.jsonl.gz"
# (prompt length, generated tokens, temperature): long turns dominate real cost; short ones show fixed overhead.
SHAPES = [(24, 512, 1.0), (64, 512, 0.7), (128, 256, 1.0), (16, 256, 0.3), (32, 64, 1.0), (8, 16, 1.0)]


def record(base_url: str, model: str) -> None:
    lines = []
    for i, (prompt_len, max_tokens, temperature) in enumerate(SHAPES):
        body = {
            "model": model,
            "prompt": [(7 * i + 13 * j) % 500 + 1 for j in range(prompt_len)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "logprobs": 8,
            "temperature": temperature,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "seed": i,
        }
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        lines.append(response.content.strip())
    OUT.write_bytes(gzip.compress(b"\n".join(lines) + b"\n", mtime=0))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {sum(s[1] for s in SHAPES)} tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running vLLM server; default: start one on a tiny model")
    parser.add_argument("--model", help="served model name (with --base-url)")
    args = parser.parse_args()
    if args.base_url:
        record(args.base_url.rstrip("/"), args.model)
        return
    from agrpo_attention.testing import save_tiny_model
    from agrpo_rollout.testing import VLLMServer

    with VLLMServer(model_dir=save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-bench-")))) as server:
        record(server.url, server.model_name)


if __name__ == "__main__":
    main()
