"""`RolloutGroup` (one prompt's `num_generations` rollouts) and the group advantage rule.

Owns the group record, `group_advantages` (standardise within the group) and `is_trainable`
(whether a group can teach anything). Pure functions of rewards: no I/O, no logging. Does not know
where rewards come from (`_reward.py`) or how samples are emitted (`_loop.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._rollout import Rollout
from ._sequence import TrainingSequence

ADVANTAGE_EPS = 1e-8


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


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """(G,) advantages: rewards standardised over the group's scored (non-NaN) rollouts; NaN -> 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros(rewards.shape[0], dtype=np.float32)
    scored = ~np.isnan(rewards)
    if scored.sum() >= 2:
        values = rewards[scored]
        advantages[scored] = (values - values.mean()) / (values.std() + ADVANTAGE_EPS)
    return advantages


def is_trainable(rewards: np.ndarray) -> tuple[bool, str]:
    """(keep, reason): a group teaches nothing with < 2 scored rollouts or all scored rewards equal."""
    scored = np.asarray(rewards, dtype=np.float64)
    scored = scored[~np.isnan(scored)]
    if scored.shape[0] < 2:
        return False, "unscorable"
    if np.all(scored == scored[0]):
        return False, "zero_std"
    return True, ""
