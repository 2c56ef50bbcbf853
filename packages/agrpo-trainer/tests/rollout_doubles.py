"""Stand-ins for the rollout side, for the trainer's tests; importable by spawned processes (pytest's
`pythonpath` lists this folder, and spawned children inherit `sys.path`).

- `fixed_samples`: GRPO-shaped samples for `agrpo_trainer.testing.ReplayTrainer`, where a test needs identical
  samples across runs (the loss normalisation and the one-rank vs two-rank comparison), never in place of a
  server where a server is the point.
- Faults the real rollout process must survive or report: a reward that raises, a loop that blocks its
  event loop (no heartbeat).
- `ToolCallingLoop` and `Counter`: a random tiny model never writes a well-formed tool call, so this loop
  samples a few real tokens per turn and appends the call a tool-using model would make (context only, not
  trained); `Counter` is the environment whose `increment` tool it calls. They make a real run log the
  `tools/` and `env/` metrics.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_packing import TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups
from agrpo_rollout import AsyncRolloutLoop, RolloutSample
from agrpo_rollout.testing import scripted_turn
from agrpo_trainer import AsyncGRPOTrainer


def fixed_samples(model: torch.nn.Module, *, num_prompts: int = 4, seed: int = 0) -> list[RolloutSample]:
    """GRPO-shaped samples (shared prompts, multi-turn, forks) whose sampler log-probs are `model`'s own."""
    shape = GroupShape(
        num_prompts=num_prompts,
        rollouts_per_prompt=4,
        prompt_tokens=(8, 20),
        completion_tokens=(4, 16),
        tool_tokens=(2, 6),
        vocab_size=model.config.vocab_size,
        multi_turn_frac=0.5,
    )
    enable_tree_attention(model, "reference")
    out = []
    rng = np.random.default_rng(seed)
    for pack in random_grpo_groups(shape, seed=seed):
        row = TreeRow(0)
        row.add(pack)
        with torch.no_grad():
            sampler = token_logprobs(model, row.pack()).numpy()
        advantage = float(rng.normal())
        out.append(
            RolloutSample(
                input_ids=pack.input_ids,
                trained_mask=pack.trained_mask,
                group_id=pack.group_id,
                advantages=np.full(pack.num_trained, advantage, dtype=np.float32),
                sampler_logprobs=sampler.astype(np.float32),
                row_index=pack.group_id,
                reward=advantage,
                advantage=advantage,
                enqueued_at=time.time(),
            )
        )
    return out


def exploding_reward(completions, **columns) -> list[float]:
    """A reward function with a bug: the trainer must stop with this traceback."""
    raise ValueError("exploding_reward: the reward function itself failed on purpose")


class BlockingLoop(AsyncRolloutLoop):
    """A loop whose rollouts block the event loop (a sync call inside an async hook): no heartbeat."""

    async def generate_one(self, prompt, tools, group_id=0):
        time.sleep(3600)


class EnvironmentReportingLoop(AsyncRolloutLoop):
    """Fails at setup with what the rollout process's environment says about GPUs and ranks."""

    async def setup(self):
        import os

        seen = {
            k: os.environ.get(k)
            for k in ("CUDA_VISIBLE_DEVICES", "RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
        }
        raise RuntimeError(f"rollout environment: {seen}")


def rank_reward(completions, **columns) -> list[float]:
    """Rewards by position in the group: every group has spread, so none is dropped (exact prompt accounting)."""
    return [i / len(completions) for i in range(len(completions))]


class Counter:
    """An environment: `reset` starts a counter, the model's tool `increment` adds to it, `get_reward` reads it."""

    def reset(self, **row):
        self.value = 4
        return "The counter starts at 4."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def get_reward(self):
        return float(self.value)


class ToolCallingLoop(AsyncRolloutLoop):
    """First turn: up to 3 real sampled tokens (those that read as letters, digits or spaces, so the script
    parses the same whatever was sampled), then a scripted `increment` call; later turns: real tokens only."""

    script = '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>'

    async def generate_one_turn(self, prompt_ids, max_tokens=None):
        real = await super().generate_one_turn(prompt_ids, max_tokens=min(3, max_tokens or 3))
        if self.tokenizer.convert_tokens_to_ids("<tool_response>") in prompt_ids:
            return real
        return scripted_turn(self.tokenizer, real, self.script)


class ToolCallingTrainer(AsyncGRPOTrainer):
    loop_cls = ToolCallingLoop


def put_and_flush(channel: Any, stop: Any, size: int) -> None:
    """A rollout worker's exit in miniature, run in a spawned process: queue `size` bytes, then flush."""
    from agrpo_trainer._rollout_process import _flush

    channel.put(b"x" * size)
    _flush(channel, stop)


def constant_reward(completions, **columns) -> list[float]:
    """Every rollout solves its prompt: each group's rewards are equal, so every group is dropped."""
    return [1.0] * len(completions)
