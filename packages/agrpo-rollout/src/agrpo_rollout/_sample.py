"""`RolloutSample`: one training sequence with its group advantage, as it crosses to the trainer.

Owns the record and `pack_fields()`, which returns exactly the fields of `agrpo_packing.PackSample`
(`PackSample(**sample.pack_fields())`), without importing packing or torch. Everything else it
carries (policy version, rewards, ids) is for staleness checks, metrics and resume. Picklable: plain
numpy arrays and Python scalars.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._group import RolloutGroup
from ._sequence import TrainingSequence

PACK_FIELDS = (
    "input_ids",
    "trained_mask",
    "group_id",
    "advantages",
    "sampler_logprobs",
    "sampler_top_ids",
    "sampler_top_logprobs",
    "sampling_mask",
    "routed_experts",
)


@dataclass(kw_only=True, slots=True)
class RolloutSample:
    """L = tokens, T = trained tokens (`trained_mask.sum()`), K = sampler top log-probs."""

    input_ids: np.ndarray
    """(L,) int64 tokens."""
    trained_mask: np.ndarray
    """(L,) bool, False at index 0."""
    group_id: int
    """Samples of one prompt's group share it."""
    advantages: np.ndarray
    """(T,) float32, the rollout's advantage repeated per trained token."""
    sampler_logprobs: np.ndarray
    """(T,) float32 sampler log-prob per trained token."""
    sampler_top_ids: np.ndarray | None = None
    """(T, K) int64, -1 padded, or None."""
    sampler_top_logprobs: np.ndarray | None = None
    """(T, K) float32, -inf padded, or None."""
    sampling_mask: list[np.ndarray] | None = None
    """T int64 candidate-id arrays, or None (vocabulary normalisation)."""
    routed_experts: np.ndarray | None = None
    """(L, layers, top_k) int16 MoE route of every token as the sampler routed it, -1 where none; None
    unless `RolloutConfig.return_routed_experts` (see `_sequence.py` for which turn's route a token keeps)."""
    policy_version: int = 0
    """Policy version when the group's first rollout was dispatched (staleness is measured from it)."""
    reward: float = float("nan")
    """The rollout's total reward."""
    advantage: float = 0.0
    """The rollout's advantage (every entry of `advantages`)."""
    group_reward_std: float = 0.0
    """Population std of the group's scored rewards (`reward_group_std`)."""
    rewards_by_func: dict[str, float] = field(default_factory=dict)
    """The rollout's reward per source, NaN where that source returned None."""
    group_rewards_by_func_std: dict[str, float] = field(default_factory=dict)
    """Per source, the std over the group (`rewards/<func>/group_std`)."""
    row_index: int = 0
    """The prompt's row in the training dataset."""
    epoch: int = 0
    """Passes over the dataset completed before the prompt was drawn."""
    rollout_id: str = ""
    """The conversation the sequence came from."""
    num_generated_tokens: int = 0
    """Tokens the rollout generated over all its turns (`completions/*`)."""
    enqueued_at: float = 0.0
    """time.time() when the loop handed the sample to its sink (wall clock: it crosses processes)."""

    @classmethod
    def from_sequence(cls, sequence: TrainingSequence, *, advantage: float, **extra: Any) -> RolloutSample:
        num_trained = sequence.num_trained
        return cls(
            input_ids=sequence.input_ids,
            trained_mask=sequence.trained_mask,
            advantages=np.full(num_trained, advantage, dtype=np.float32),
            sampler_logprobs=sequence.sampler_logprobs,
            sampler_top_ids=sequence.sampler_top_ids,
            sampler_top_logprobs=sequence.sampler_top_logprobs,
            sampling_mask=sequence.sampling_mask,
            routed_experts=sequence.routed_experts,
            advantage=float(advantage),
            rollout_id=sequence.rollout_id,
            **extra,
        )

    def pack_fields(self) -> dict[str, Any]:
        """Exactly the keyword arguments of `agrpo_packing.PackSample`."""
        return {name: getattr(self, name) for name in PACK_FIELDS}

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.advantages.shape[0])


def samples_from_group(group: RolloutGroup, advantages: np.ndarray) -> list[RolloutSample]:
    """Every training sequence of a scored group, with its rollout's advantage and the group's stats."""
    scored = group.rewards[~np.isnan(group.rewards)]
    group_std = float(scored.std()) if scored.size else 0.0
    stds = {k: 0.0 if np.all(np.isnan(v)) else float(np.nanstd(v)) for k, v in group.rewards_by_func.items()}
    return [
        RolloutSample.from_sequence(
            sequence,
            advantage=float(advantages[i]),
            group_id=group.group_id,
            policy_version=group.model_version,
            reward=float(group.rewards[i]),
            group_reward_std=group_std,
            rewards_by_func={k: float(v[i]) for k, v in group.rewards_by_func.items()},
            group_rewards_by_func_std=stds,
            row_index=group.row_index,
            epoch=group.epoch,
            num_generated_tokens=len(group.completions_ids[i]),
        )
        for i, sequences in enumerate(group.completions_sequences)
        for sequence in sequences
    ]
