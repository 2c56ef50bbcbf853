"""Stale prefix KV after a sync: how far new requests' sampler log-probs are from the served weights,
with `pause_clear_cache` False and True, on a real CPU vLLM server.

One measurement: a request caches a `prefix_len`-token prefix under the current weights, the trainer
pushes new weights (disk backend, `pause_mode="keep"`), then a new request reusing that prefix samples
`num_tokens` tokens greedily; its log-probs are compared with the trainer's own for the same tokens
(float32 on both sides). With `pause_clear_cache=False` vLLM keeps the prefix blocks computed under the
old weights and the new request attends to them; with True it clears them and re-prefills.
Requests are unseeded: vLLM 0.32's CPU build crashes ("CPU Generator does not use offset") when a seeded
request's re-prefill is chunked.

Run it (starts its own server, about a minute on 2 cores):
    uv run python packages/agrpo-sync/tests/stale_prefix_probe.py [--repeats 3]
`tests/test_stale_prefix.py` runs `measure` against the session's server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from agrpo_sync import WeightSync, WeightSyncConfig


def _perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Seeded noise on every parameter but the tied embedding (a CPU server never refreshes a tied head)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" not in name:
                param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _complete(
    url: str, model_name: str, prompt: list[int], num_tokens: int
) -> tuple[list[int], list[float], float]:
    body = {
        "model": model_name, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    begin = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    elapsed = time.perf_counter() - begin
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], elapsed


@torch.no_grad()
def _trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def measure(
    url: str,
    model_name: str,
    model: torch.nn.Module,
    output_dir: str,
    *,
    clear_cache: bool | None,
    version: int,
    prefix_len: int = 300,
    num_tokens: int = 16,
) -> dict[str, float]:
    """Cache a prefix, sync `model` perturbed (seed `version`), then score a new request on that prefix.
    `clear_cache=None` keeps the config's default."""
    generator = torch.Generator().manual_seed(version)
    vocab = model.config.vocab_size
    prefix = torch.randint(10, vocab, (prefix_len,), generator=generator).tolist()
    first, second = (torch.randint(10, vocab, (8,), generator=generator).tolist() for _ in range(2))
    _complete(url, model_name, prefix + first, 1)  # the prefix's blocks are now cached, old weights
    overrides = {} if clear_cache is None else {"pause_clear_cache": clear_cache}
    config = WeightSyncConfig(base_url=url, output_dir=output_dir, backend="disk", **overrides)
    sync = WeightSync.start(config, model)
    _perturb(model, version)
    timings = sync.sync(model, version)
    sync.close()
    tokens, server, latency = _complete(url, model_name, prefix + second, num_tokens)
    error = (torch.tensor(server) - _trainer_logprobs(model, prefix + second, tokens)).abs()
    return {
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
        "stage_s": timings.stage_s,
        "generation_paused_s": timings.generation_paused_s,
        "first_request_s": latency,
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the workspace root, for `tools`
    from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer, save_tiny_model
    from agrpo_rollout.testing import VLLMServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="measurements per setting")
    args = parser.parse_args()
    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-stale-prefix-")), TinyModelSpec())
    model = build_model(TinyModelSpec(), build_tokenizer())
    rows = []
    with VLLMServer(model_dir=model_dir) as server:
        for repeat in range(args.repeats):
            for clear_cache in (False, True):
                version = 1 + 2 * repeat + int(clear_cache)
                result = measure(
                    server.url,
                    server.model_name,
                    model,
                    str(model_dir / "run"),
                    clear_cache=clear_cache,
                    version=version,
                )
                rows.append((clear_cache, result))
                print(
                    f"pause_clear_cache={clear_cache!s:5} "
                    + " ".join(f"{k}={v:.3g}" for k, v in result.items())
                )
    for clear_cache in (False, True):
        errors = [r["max_abs_error"] for c, r in rows if c == clear_cache]
        paused = [r["generation_paused_s"] for c, r in rows if c == clear_cache]
        staged = [r["stage_s"] for c, r in rows if c == clear_cache]
        first = [r["first_request_s"] for c, r in rows if c == clear_cache]
        print(
            f"summary pause_clear_cache={clear_cache}: max log-prob error {max(errors):.3g} nats "
            f"(min {min(errors):.3g}), written before the pause {sum(staged) / len(staged) * 1e3:.0f} ms, "
            f"generation paused {sum(paused) / len(paused) * 1e3:.0f} ms, "
            f"first request after the sync {sum(first) / len(first) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
