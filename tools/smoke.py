"""The pipeline without training: rollouts → samples → prefix-tree rows → exact log-probs.

Runs every library of the workspace end to end against a real local CPU vLLM server (the training demo is
`tools/demo.py`; this smoke path stays as a check of the token bookkeeping): agrpo-rollout generates GRPO groups
for embedded arithmetic prompts and scores them; each sample converts to an agrpo-packing `PackSample`;
the planner packs groups into prefix-tree rows; agrpo-attention forwards each row once through the
same tiny model with tree attention and recovers every trained token's log-prob, which must equal the
sampler's (both run the same float32 weights). Does not train: there is no loss or optimizer yet.

Run: `uv run python -m tools.smoke` (about a minute for the server, seconds for the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import save_tiny_model
from agrpo_packing import PackingConfig, PackSample, Planner
from agrpo_rollout import AsyncRolloutLoop, RolloutConfig, RolloutSample
from agrpo_rollout.testing import VLLMServer

PROMPTS = [f"What is {a} + {b}? Answer with a number." for a, b in [(2, 3), (17, 25), (40, 2), (7, 8)]]


def digit_fraction(completions, **columns) -> list[float]:
    """A smoke reward that varies even for a random model: the share of digits in the answer."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


@dataclass(kw_only=True, slots=True)
class SmokeReport:
    """What one pass of the pipeline produced."""

    num_samples: int
    num_rows: int
    raw_tokens: int
    forwarded_tokens: int
    num_loss_terms: int
    max_logprob_error: float
    """Largest |log-prob from the packed forward - sampler log-prob| over all trained tokens."""
    mean_reward: float

    @property
    def packing_ratio(self) -> float:
        return self.raw_tokens / max(self.forwarded_tokens, 1)


async def collect_samples(
    url: str, model_dir: Path, num_generations: int, max_tokens: int
) -> list[RolloutSample]:
    """One pass over the embedded prompts; every kept group's samples."""
    config = RolloutConfig(
        vllm_server_base_url=url, num_generations=num_generations, max_completion_length=max_tokens
    )
    dataset = [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]
    loop = AsyncRolloutLoop(
        config,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        dataset=dataset,
        reward_funcs=digit_fraction,
        max_epochs=1,
    )
    samples: list[RolloutSample] = []
    await loop.run(samples.append)
    return samples


def packed_logprob_error(model_dir: Path, samples: list[RolloutSample]) -> SmokeReport:
    """Pack the samples into prefix-tree rows and compare packed log-probs with the sampler's."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enable_tree_attention(model, backend="reference")
    planner = Planner(PackingConfig(token_budget=4096, num_ranks=1))
    rows = [
        row
        for batch in planner.plan([PackSample(**s.pack_fields()) for s in samples])
        for row in batch.pack()
    ]
    error = 0.0
    with torch.no_grad():
        for row in rows:
            error = max(error, (token_logprobs(model, row) - row.sampler_logprobs).abs().max().item())
    return SmokeReport(
        num_samples=len(samples),
        num_rows=len(rows),
        raw_tokens=sum(r.num_raw_tokens for r in rows),
        forwarded_tokens=sum(r.num_tokens for r in rows),
        num_loss_terms=sum(r.num_loss_terms for r in rows),
        max_logprob_error=error,
        mean_reward=sum(s.reward for s in samples) / max(len(samples), 1),
    )


def run_smoke(url: str, model_dir: Path, num_generations: int = 4, max_tokens: int = 48) -> SmokeReport:
    samples = asyncio.run(collect_samples(url, model_dir, num_generations, max_tokens))
    if not samples:
        raise RuntimeError("every group was dropped (all rewards equal); nothing reached packing")
    return packed_logprob_error(model_dir, samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-demo-")))
    print(f"tiny Qwen3 in {model_dir}; starting the CPU vLLM server (about a minute)...", flush=True)
    with VLLMServer(model_dir=model_dir) as server:
        report = run_smoke(server.url, model_dir, args.num_generations, args.max_tokens)
    print(
        f"{report.num_samples} samples (mean reward {report.mean_reward:.3f}) -> {report.num_rows} rows: "
        f"{report.raw_tokens} raw tokens forwarded as {report.forwarded_tokens} "
        f"(packing ratio {report.packing_ratio:.2f}); {report.num_loss_terms} trained tokens, "
        f"max |packed - sampler| log-prob {report.max_logprob_error:.2e}"
    )


if __name__ == "__main__":
    main()
