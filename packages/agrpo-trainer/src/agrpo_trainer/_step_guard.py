"""`EmptyStepGuard`: a run whose optimizer steps update nothing stops, loudly.

Owns one rule: when `limit` optimizer steps in a row had loss terms but masked importance sampling
excluded every one of them (`sampling/masked_mean` 1.0), the policy and the sampler disagree on every
token, the loss and gradient are zero, and more steps cannot change that. Usual causes: the server's
log-probs are not those of the distribution it sampled from (`--logprobs-mode raw_logprobs` under a
temperature, penalties or truncation), the server serves other weights than the trainer's (a failed sync;
`sync/logprob_max_abs_diff` says so), or IS clip bounds too tight. Raises `NothingTrainedError` naming
them. The statistics are every rank's (`all_ranks`), so every rank raises at the same step. Does not
know where the numbers come from.
"""

from __future__ import annotations

from ._exceptions import NothingTrainedError


class EmptyStepGuard:
    """`check(LossStats.metrics())` after each optimizer step; raises after `limit` empty steps in a row."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.empty_in_a_row = 0

    def check(self, metrics: dict[str, float], step: int) -> None:
        trained = metrics.get("num_terms", 0.0) > 0
        empty = trained and metrics.get("sampling/masked_mean", 0.0) >= 1.0
        self.empty_in_a_row = self.empty_in_a_row + 1 if empty else 0
        if self.empty_in_a_row < self.limit:
            return
        ratio = metrics.get("sampling/importance_sampling_ratio/mean", float("nan"))
        raise NothingTrainedError(
            f"optimizer steps {step - self.limit + 1}-{step} excluded every loss term from the loss (all importance "
            f"ratios outside [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]; mean ratio "
            f"{ratio:.3g}), so nothing was trained. Check that the server returns the log-probs it sampled from "
            "(--logprobs-mode processed_logprobs), that it serves the trainer's weights (sync/logprob_max_abs_diff), "
            "and the IS clip bounds"
        )
