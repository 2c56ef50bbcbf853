"""`TurnRecord`: one sampling request, its prompt and what the sampler produced; `TopLogprobs`.

Owns the per-token arrays of one turn and their alignment checks. Does not know HTTP (the client
fills it), chat templates, or how turns chain into training sequences (`_sequence.py`).

Shapes: P = prompt tokens, T = output tokens, K = sampler top log-probs kept per output token, E = the
model's layers, k = experts per token. Every per-output-token field is aligned to `output_ids`; MoE routes
are aligned to prompt and output together. Arrays are numpy so a 2k-token turn costs
a few allocations, not 2k Python objects; list inputs are converted once on construction.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TopLogprobs:
    """The sampler's K most likely tokens at each output position, as dense arrays.

    Reads like the reference's `list[dict[int, float]]` (`len`, indexing, iteration give dicts) but
    stores two (T, K) arrays: ids padded with -1, log-probs padded with -inf.
    """

    ids: np.ndarray
    """(T, K) int64 token ids, -1 where the server returned fewer than K. A row is a set: its order is
    the server's (vLLM lists the sampled token first when it is among the top K)."""
    logprobs: np.ndarray
    """(T, K) float32 log-probs of `ids`, -inf where the id is -1."""

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        if self.ids.ndim != 2 or self.ids.shape != self.logprobs.shape:
            raise ValueError(f"ids {self.ids.shape} and logprobs {self.logprobs.shape} must both be (T, K)")

    @classmethod
    def from_dicts(cls, rows: Sequence[Mapping[int, float]], k: int | None = None) -> TopLogprobs:
        """Pack `[{token_id: logprob}, ...]` into arrays, keeping the `k` most likely per row (most likely first)."""
        k = max((len(r) for r in rows), default=0) if k is None else k
        ids = np.full((len(rows), k), -1, dtype=np.int64)
        logprobs = np.full((len(rows), k), -np.inf, dtype=np.float32)
        for i, row in enumerate(rows):
            best = sorted(row.items(), key=lambda item: -item[1])[:k]
            for j, (token_id, logprob) in enumerate(best):
                ids[i, j], logprobs[i, j] = int(token_id), logprob
        return cls(ids=ids, logprobs=logprobs)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, position: int) -> dict[int, float]:
        keep = self.ids[position] >= 0
        return dict(
            zip(self.ids[position][keep].tolist(), self.logprobs[position][keep].tolist(), strict=True)
        )

    def __iter__(self) -> Iterator[dict[int, float]]:
        return (self[i] for i in range(len(self)))


@dataclass(slots=True)
class TurnRecord:
    """One sampling request: the prompt sent, the tokens sampled and the sampler's view of each token."""

    prompt_ids: np.ndarray
    """(P,) int64 token ids of the whole prompt, including every earlier turn of the conversation."""
    output_ids: np.ndarray
    """(T,) int64 token ids the sampler produced (an EOS or stop token included when it ended the turn)."""
    output_log_probs: np.ndarray | None = None
    """(T,) float32 sampler log-prob of each output token; needed when any output token is trained."""
    output_mask: np.ndarray | None = None
    """(T,) bool: True trains the token, False keeps it as context only. None: every token is trained."""
    output_sampling_mask: list[np.ndarray] | None = None
    """T int64 arrays: the candidate ids each token was sampled from after top-k/top-p. None: the vocabulary."""
    output_sampler_logprobs: TopLogprobs | None = None
    """The sampler's top log-probs per output token (score centering); a `list[dict]` is converted."""
    finish_reason: str | None = None
    """Why the server stopped: `stop` (EOS or stop token), `length`, `abort`; None when not sampled."""
    routed_experts: np.ndarray | None = None
    """(P + T, E, k) int16 experts each token of `prompt_ids` then `output_ids` was routed to, as input, in
    each layer (MoE routing replay); -1 throughout a token the request returned no route for (the last
    output token, prompt tokens before its `routed_experts_prompt_start`). None: not asked for."""

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.output_ids = np.asarray(self.output_ids, dtype=np.int64)
        num_out = self.output_ids.shape[0]
        if self.output_log_probs is not None:
            self.output_log_probs = np.asarray(self.output_log_probs, dtype=np.float32)
            _check_len("output_log_probs", self.output_log_probs.shape[0], num_out)
        if self.output_mask is not None:
            self.output_mask = np.asarray(self.output_mask, dtype=bool)
            _check_len("output_mask", self.output_mask.shape[0], num_out)
        if self.output_log_probs is None and bool(self.trained_mask.any()):
            raise ValueError(
                "output_log_probs is None but some output tokens are trained; pass the sampler's log-probs "
                "or set output_mask to 0 for tokens the sampler did not produce"
            )
        if self.output_sampling_mask is not None:
            self.output_sampling_mask = [np.asarray(m, dtype=np.int64) for m in self.output_sampling_mask]
            _check_len("output_sampling_mask", len(self.output_sampling_mask), num_out)
        if self.output_sampler_logprobs is not None and not isinstance(
            self.output_sampler_logprobs, TopLogprobs
        ):
            self.output_sampler_logprobs = TopLogprobs.from_dicts(self.output_sampler_logprobs)
        if self.output_sampler_logprobs is not None:
            _check_len("output_sampler_logprobs", len(self.output_sampler_logprobs), num_out)
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts, dtype=np.int16)
            num_tokens = self.prompt_ids.shape[0] + num_out
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != num_tokens:
                raise ValueError(
                    f"routed_experts has shape {self.routed_experts.shape}; expected ({num_tokens}, layers, "
                    "top_k): one route per prompt and output token, -1 where there is none"
                )

    @property
    def trained_mask(self) -> np.ndarray:
        """(T,) bool: which output tokens are trained."""
        if self.output_mask is None:
            return np.ones(self.output_ids.shape[0], dtype=bool)
        return self.output_mask

    @property
    def num_output_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def stopped(self) -> bool:
        """True when the sampler ended the turn itself (EOS or stop token) rather than a length cap."""
        return self.finish_reason == "stop"


def _check_len(name: str, got: int, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{name} has {got} entries for {expected} output tokens; give one per output token")
