"""`PackSample`: one training sequence as packing sees it.

Owns the record and its validation. Does not know where samples come from (agrpo-rollout's sample
record converts to it field for field: `PackSample(**record.pack_fields())`) nor how rows are built.

Shapes: L = sequence length, T = number of trained tokens (`trained_mask.sum()`), K = sampler top
log-probs per trained token. Per-trained-token arrays are aligned to the trained tokens in order, i.e.
to the loss terms: entry j belongs to the j-th position i with `trained_mask[i]`, which is predicted by
position i - 1.
`routed_experts` is the one per-token array aligned to all of `input_ids` (MoE routing replay): (L,
num_layers, top_k), -1 for a token without a route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._exceptions import PackingError

_MAX_TOKEN_ID = np.iinfo(np.int64).max
_MAX_EXPERT_ID = np.iinfo(np.int16).max


@dataclass(kw_only=True, slots=True)
class PackSample:
    """One sequence to train on: its tokens, which of them are trained, and per trained token the data
    the loss needs. Optional sampler data is carried through packing untouched."""

    input_ids: np.ndarray
    """(L,) int token ids, >= 0, L >= 1. Floats are refused, not truncated (5.7 is no token id)."""
    trained_mask: np.ndarray
    """(L,) bool; True where the token is sampled (trained). `trained_mask[0]` must be False: the first
    token has no predecessor to predict it."""
    group_id: int
    """Samples of one GRPO group (same prompt) share it; the planner routes them to one row."""
    advantages: np.ndarray
    """(T,) float32 advantage per trained token; finite (as float32)."""
    sampler_logprobs: np.ndarray
    """(T,) float32 log-prob the sampler gave each trained token; finite."""
    sampler_top_ids: np.ndarray | None = None
    """(T, K) int ids of the sampler's top-K alternatives per trained token, -1 where fewer than K."""
    sampler_top_logprobs: np.ndarray | None = None
    """(T, K) float32 log-probs of `sampler_top_ids`, -inf where the id is -1."""
    sampling_mask: Sequence[np.ndarray] | None = None
    """T arrays of int ids: the candidate set (after top-k/top-p) each trained token was sampled from."""
    routed_experts: np.ndarray | None = None
    """(L, num_layers, top_k) int expert ids each token (as input) was routed to by the sampler, per layer
    (MoE routing replay), stored as int16; -1 in every slot of a token without a route. Aligned to all of
    `input_ids`, not to trained tokens. None: the sample carries no routes."""

    def __post_init__(self) -> None:
        self.input_ids = _token_ids(self.input_ids)
        self.trained_mask = np.asarray(self.trained_mask, dtype=bool)
        self.advantages = _finite_float32(
            "advantages", self.advantages, "a non-finite reward makes non-finite advantages; drop the sample"
        )
        self.sampler_logprobs = _finite_float32(
            "sampler_logprobs",
            self.sampler_logprobs,
            "a sampled token had probability > 0; check the sampler's log-probs for this sample",
        )
        length = self.input_ids.shape[0]
        if self.input_ids.ndim != 1 or self.trained_mask.shape != (length,):
            raise PackingError(
                f"input_ids {self.input_ids.shape} and trained_mask {self.trained_mask.shape} must be 1-D "
                "of the same length"
            )
        if self.trained_mask[0]:
            raise PackingError("trained_mask[0] is True: the first token has no position that predicts it")
        num_trained = int(self.trained_mask.sum())
        self._check_per_trained("advantages", self.advantages, num_trained)
        self._check_per_trained("sampler_logprobs", self.sampler_logprobs, num_trained)
        if (self.sampler_top_ids is None) != (self.sampler_top_logprobs is None):
            raise PackingError("sampler_top_ids and sampler_top_logprobs come together: pass both or neither")
        if self.sampler_top_ids is not None:
            self.sampler_top_ids = np.asarray(self.sampler_top_ids, dtype=np.int64)
            self.sampler_top_logprobs = np.asarray(self.sampler_top_logprobs, dtype=np.float32)
            self._check_per_trained("sampler_top_ids", self.sampler_top_ids, num_trained)
            if self.sampler_top_logprobs.shape != self.sampler_top_ids.shape:
                raise PackingError(
                    f"sampler_top_logprobs {self.sampler_top_logprobs.shape} must match "
                    f"sampler_top_ids {self.sampler_top_ids.shape}"
                )
        if self.sampling_mask is not None and len(self.sampling_mask) != num_trained:
            raise PackingError(
                f"sampling_mask has {len(self.sampling_mask)} sets for {num_trained} trained tokens"
            )
        if self.routed_experts is not None:
            self.routed_experts = _routes(self.routed_experts, length)

    @staticmethod
    def _check_per_trained(name: str, values: np.ndarray, num_trained: int) -> None:
        if values.shape[:1] != (num_trained,):
            raise PackingError(
                f"{name} has shape {values.shape}; expected one entry per trained token ({num_trained}, ...). "
                "Per-token arrays are aligned to trained tokens only, not to all of input_ids."
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.advantages.shape[0])


def _token_ids(values) -> np.ndarray:
    """`values` as (L,) int64, refusing what a cast would silently change: floats (5.7 -> 5), negative or
    out-of-range ids, and an empty sample (it has no token to train or to condition on)."""
    raw = np.asarray(values)
    if raw.size == 0:
        raise PackingError(
            "empty sample: input_ids has no tokens; drop the sample before packing (a sample needs at least one token)"
        )
    flat = raw.reshape(-1)
    if raw.dtype.kind not in "iu":
        if raw.dtype.kind == "f":
            bad = np.flatnonzero(flat != np.round(flat))
        else:  # bool, str, object: the first entry that is not an int
            bad = [
                i for i, x in enumerate(flat) if isinstance(x, bool) or not isinstance(x, int | np.integer)
            ]
        index = int(bad[0]) if len(bad) else 0
        raise PackingError(
            f"input_ids[{index}] is {flat[index].item()!r}: token ids are integers (got dtype {raw.dtype}); "
            "pass a list or array of ints (the tokenizer's ids), not floats"
        )
    if raw.dtype.kind == "u" and int(flat.max()) > _MAX_TOKEN_ID:
        index = int(np.argmax(flat > _MAX_TOKEN_ID))
        raise PackingError(f"input_ids[{index}] is {int(flat[index])}: token ids are < 2**63")
    ids = raw.astype(np.int64)
    if (negative := np.flatnonzero(flat < 0)).size:
        raise PackingError(
            f"input_ids[{negative[0]}] is {flat[negative[0]]}: token ids are >= 0; a negative id is usually "
            "padding (-100, -1) left in the sequence: strip it before making the sample"
        )
    return ids


def _routes(values, length: int) -> np.ndarray:
    """`values` as (L, num_layers, top_k) int16, refusing what replay could not use: another length than
    `input_ids`, floats, and ids below -1 (the no-route marker) or beyond int16."""
    routes = np.asarray(values)
    if routes.ndim != 3 or routes.shape[0] != length:
        raise PackingError(
            f"routed_experts has shape {routes.shape}; expected ({length}, num_layers, top_k): one route per "
            "token of input_ids (-1 for a token without one), not per trained token"
        )
    if routes.dtype.kind not in "iu":
        raise PackingError(f"routed_experts has dtype {routes.dtype}; expert ids are integers (-1: no route)")
    if routes.size and (int(routes.min()) < -1 or int(routes.max()) > _MAX_EXPERT_ID):
        bad = np.argwhere((routes < -1) | (routes > _MAX_EXPERT_ID))[0]
        raise PackingError(
            f"routed_experts[{', '.join(map(str, bad))}] is {int(routes[tuple(bad)])}: expert ids are in "
            f"[0, {_MAX_EXPERT_ID}], and -1 marks a token without a route"
        )
    return routes.astype(np.int16, copy=False)


def _finite_float32(name: str, values, why: str) -> np.ndarray:
    """`values` as float32, refusing NaN and +-inf (also values a float32 cast overflows, such as 1e308),
    which would turn the loss and every gradient into NaN."""
    with np.errstate(over="ignore"):
        converted = np.asarray(values, dtype=np.float32)
    bad = np.argwhere(~np.isfinite(converted))
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        given = np.asarray(values).reshape(converted.shape)[index]
        overflow = " as float32" if np.isfinite(given) else ""
        position = ", ".join(map(str, index))
        raise PackingError(
            f"{name}[{position}] is {converted[index]}{overflow}: {name} must be finite ({why})"
        )
    return converted
