"""`PackSample`: one training sequence as packing sees it.

Owns the record and its validation. Does not know where samples come from (agrpo-rollout's sample
record converts to it field for field: `PackSample(**record.pack_fields())`) nor how rows are built.

Shapes: L = sequence length, T = number of trained tokens (`trained_mask.sum()`), K = sampler top
log-probs per trained token. Per-trained-token arrays are aligned to the trained tokens in order, i.e.
to the loss terms: entry j belongs to the j-th position i with `trained_mask[i]`, which is predicted by
position i - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(kw_only=True, slots=True)
class PackSample:
    """One sequence to train on: its tokens, which of them are trained, and per trained token the data
    the loss needs. Optional sampler data is carried through packing untouched."""

    input_ids: np.ndarray
    """(L,) int token ids."""
    trained_mask: np.ndarray
    """(L,) bool; True where the token is sampled (trained). `trained_mask[0]` must be False: the first
    token has no predecessor to predict it."""
    group_id: int
    """Samples of one GRPO group (same prompt) share it; the planner routes them to one row."""
    advantages: np.ndarray
    """(T,) float32 advantage per trained token."""
    sampler_logprobs: np.ndarray
    """(T,) float32 log-prob the sampler gave each trained token."""
    sampler_top_ids: np.ndarray | None = None
    """(T, K) int ids of the sampler's top-K alternatives per trained token, -1 where fewer than K."""
    sampler_top_logprobs: np.ndarray | None = None
    """(T, K) float32 log-probs of `sampler_top_ids`, -inf where the id is -1."""
    sampling_mask: Sequence[np.ndarray] | None = None
    """T arrays of int ids: the candidate set (after top-k/top-p) each trained token was sampled from."""

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64)
        self.trained_mask = np.asarray(self.trained_mask, dtype=bool)
        self.advantages = np.asarray(self.advantages, dtype=np.float32)
        self.sampler_logprobs = np.asarray(self.sampler_logprobs, dtype=np.float32)
        length = self.input_ids.shape[0]
        if self.input_ids.ndim != 1 or self.trained_mask.shape != (length,):
            raise ValueError(
                f"input_ids {self.input_ids.shape} and trained_mask {self.trained_mask.shape} must be 1-D "
                "of the same length"
            )
        if length and self.trained_mask[0]:
            raise ValueError("trained_mask[0] is True: the first token has no position that predicts it")
        num_trained = int(self.trained_mask.sum())
        self._check_per_trained("advantages", self.advantages, num_trained)
        self._check_per_trained("sampler_logprobs", self.sampler_logprobs, num_trained)
        if (self.sampler_top_ids is None) != (self.sampler_top_logprobs is None):
            raise ValueError("sampler_top_ids and sampler_top_logprobs come together: pass both or neither")
        if self.sampler_top_ids is not None:
            self.sampler_top_ids = np.asarray(self.sampler_top_ids, dtype=np.int64)
            self.sampler_top_logprobs = np.asarray(self.sampler_top_logprobs, dtype=np.float32)
            self._check_per_trained("sampler_top_ids", self.sampler_top_ids, num_trained)
            if self.sampler_top_logprobs.shape != self.sampler_top_ids.shape:
                raise ValueError(
                    f"sampler_top_logprobs {self.sampler_top_logprobs.shape} must match "
                    f"sampler_top_ids {self.sampler_top_ids.shape}"
                )
        if self.sampling_mask is not None and len(self.sampling_mask) != num_trained:
            raise ValueError(
                f"sampling_mask has {len(self.sampling_mask)} sets for {num_trained} trained tokens"
            )

    @staticmethod
    def _check_per_trained(name: str, values: np.ndarray, num_trained: int) -> None:
        if values.shape[:1] != (num_trained,):
            raise ValueError(
                f"{name} has shape {values.shape}; expected one entry per trained token ({num_trained}, ...). "
                "Per-token arrays are aligned to trained tokens only, not to all of input_ids."
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.advantages.shape[0])
