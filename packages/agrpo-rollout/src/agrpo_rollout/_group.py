"""`RolloutGroup` (one prompt's `num_generations` rollouts) and the group advantage rule.

Owns the group record (and `FinishedRollout`, what one rollout adds to it), which rewards count (`usable_rewards`), `group_advantages` (standardise within
the group), `is_trainable` (whether a group can teach anything) and `prompt_preview` (how errors name a
group's prompt). Pure functions: no I/O, no logging. Does not know where rewards come from (`_reward.py`) or how samples are emitted (`_loop.py`).

A reward counts when it is a number with |r| <= `REWARD_LIMIT` (float32's largest): NaN (no score),
+-inf and values such as 1e308 are excluded alike. Beyond float32's range a sample's reward becomes
inf and the group's mean and variance can overflow even in float64 (1e308 + 1e308), which would make
NaN advantages; within it, squares stay below 1e77, so every advantage is finite.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._rollout import Rollout
from ._sequence import TrainingSequence

ADVANTAGE_EPS = 1e-8
REWARD_LIMIT = float(np.finfo(np.float32).max)
"""Largest |reward| that counts (about 3.4e38); larger ones and +-inf are excluded like NaN."""


@dataclass(slots=True)
class FinishedRollout:
    """One finished rollout with what scoring needs."""

    prompt: Any
    rollout: Rollout
    sequences: list[TrainingSequence]
    env_reward: tuple[type, float] | None


@dataclass(slots=True)
class RolloutGroup:
    """The rollouts of one prompt, scored together; every list has one entry per rollout."""

    prompts: list[Any]
    """Each rollout's prompt (message list or text), after environment `reset` additions."""
    reward_kwargs: dict[str, list[Any]]
    """The prompt row's other columns, one list entry per rollout, passed to reward functions."""
    completions: list[Any]
    """Each rollout's completion (messages or text)."""
    completions_ids: list[list[int]]
    """Each rollout's generated token ids."""
    completions_sequences: list[list[TrainingSequence]]
    """Each rollout's training sequences (more than one when a turn forked)."""
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    """Policy version when the group's first rollout was dispatched."""
    group_id: int
    """Counts groups from 0 in this loop."""
    row_index: int
    """The prompt's row in the training dataset."""
    env_rewards: list[tuple[type, float] | None]
    """(environment class, its get_reward()) per rollout, None without one."""
    rollout_rewards: list[float | None]
    """Each rollout's `Rollout.reward`."""
    queued_at: float = 0.0
    """time.monotonic() when the group was queued for scoring."""
    rewards: np.ndarray | None = None
    """(G,) total reward per rollout, NaN where no source scored; set before `compute_advantages`."""
    rewards_by_func: dict[str, np.ndarray] = field(default_factory=dict)
    """(G,) per reward source (function name or environment class), NaN where it returned None."""
    rollouts: list[Rollout] = field(default_factory=list)
    """The rollouts themselves."""
    epoch: int = 0
    """Passes over the dataset completed before this prompt was drawn."""

    def collect(self, finished: list[FinishedRollout]) -> None:
        """Fill the per-rollout lists from the group's finished rollouts, in generation order."""
        self.prompts = [f.prompt for f in finished]
        self.rollouts = [f.rollout for f in finished]
        self.completions = [f.rollout.completion for f in finished]
        self.completions_ids = [f.rollout.completion_ids for f in finished]
        self.completions_sequences = [f.sequences for f in finished]
        self.tool_call_counts = [f.rollout.tool_call_count for f in finished]
        self.tool_failure_counts = [f.rollout.tool_failure_count for f in finished]
        self.env_rewards = [f.env_reward for f in finished]
        self.rollout_rewards = [f.rollout.reward for f in finished]
        self.queued_at = time.monotonic()


def prompt_preview(prompt: Any, limit: int = 120) -> str:
    """The prompt's last user text (or the text prompt), cut to `limit` characters: names a row in errors."""
    if isinstance(prompt, list | tuple):
        texts = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = texts[-1] if texts else prompt
    text = str(prompt)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def usable_rewards(rewards: np.ndarray) -> np.ndarray:
    """(G,) bool: which rewards count (a number with |r| <= REWARD_LIMIT; NaN and +-inf do not)."""
    with np.errstate(invalid="ignore"):
        return np.abs(np.asarray(rewards, dtype=np.float64)) <= REWARD_LIMIT


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """(G,) finite advantages: rewards standardised over the group's usable rewards; the others get 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros(rewards.shape[0], dtype=np.float32)
    scored = usable_rewards(rewards)
    if scored.sum() >= 2:
        values = rewards[scored]
        advantages[scored] = (values - values.mean()) / (values.std() + ADVANTAGE_EPS)
    return advantages


def is_trainable(rewards: np.ndarray) -> tuple[bool, str]:
    """(keep, reason): a group teaches nothing with < 2 usable rewards or all usable rewards equal."""
    scored = np.asarray(rewards, dtype=np.float64)
    scored = scored[usable_rewards(scored)]
    if scored.shape[0] < 2:
        return False, "unscorable"
    if np.all(scored == scored[0]):
        return False, "zero_std"
    return True, ""
