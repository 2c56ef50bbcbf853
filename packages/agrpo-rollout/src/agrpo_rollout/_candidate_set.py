"""Candidate sets of top-k / top-p / min-p sampling, read from the sampler's own top log-probs.

Owns the rule that lets a server without sampling masks (`--return-sampling-mask` needs vLLM's V2 model
runner, which the CPU build and many GPU servers lack) still give the trainer each token's exact candidate
set. With `--logprobs-mode processed_logprobs` the log-probs vLLM returns are those of the distribution it
sampled from: temperature applied, then min-p, top-k and top-p, every token outside the candidate set at
-inf (sent as -9999.0). Every one of these sets lies within the top_k most likely tokens (the config
requires `top_k > 0` for top-p and min-p), so asking for `top_k + 1` log-probs per token returns the whole
set plus at least one masked entry, which proves the set ended there. A completion without any masked
entry means the server does not run in processed mode (its log-probs ignore the truncation): that raises,
naming the flag, instead of training on biased ratios (a single row without one is a tie at the k-th
logit, which vLLM keeps: its N entries are the set). Does not know HTTP or how sets are packed (agrpo-packing).

Legend: T = output tokens, N = log-probs returned per token (top_k + 1 or more), K = the config's
`num_sampler_logprobs` kept for score centering.
"""

from __future__ import annotations

import numpy as np

from ._config import RolloutConfig
from ._exceptions import ServerConfigError
from ._turn import TopLogprobs


def candidate_logprobs(config: RolloutConfig) -> int:
    """Log-probs to request per token so that every candidate set arrives whole (`top_k + 1`), or the config's
    `num_sampler_logprobs` when sampling does not truncate the vocabulary."""
    if not config.truncates_vocabulary:
        return config.num_sampler_logprobs
    return max(config.num_sampler_logprobs, config.top_k + 1)


def split_candidate_sets(
    top: TopLogprobs, output_ids: np.ndarray, config: RolloutConfig, base_url: str
) -> tuple[TopLogprobs | None, list[np.ndarray]]:
    """(the K most likely entries, for score centering, or None when K = 0; each token's candidate ids)
    from the (T, N) top log-probs of a processed-logprobs response."""
    finite = np.isfinite(top.logprobs) & (top.ids >= 0)
    if len(top) and finite.all():  # (a tie at the k-th logit can fill one row; raw log-probs fill every row)
        raise ServerConfigError(
            f"{base_url} returned {top.ids.shape[1]} finite log-probs for every token of a completion sampled "
            f"with top_k={config.top_k}: its log-probs ignore the truncation (it does not run "
            "--logprobs-mode processed_logprobs), so candidate sets cannot be read. Restart it with "
            "--logprobs-mode processed_logprobs, or with --enable-scale-out --return-sampling-mask (vLLM >= 0.28, "
            "V2 model runner)"
        )
    sets = [row_ids[row_finite] for row_ids, row_finite in zip(top.ids, finite, strict=True)]
    for position, (token, members) in enumerate(zip(output_ids.tolist(), sets, strict=True)):
        if token not in members:
            raise ServerConfigError(
                f"{base_url} sampled token {token} at output position {position} outside the candidate set its "
                "processed log-probs describe; check that --logprobs-mode processed_logprobs is set and that no "
                "logits processor changes the distribution after sampling"
            )
    k = config.num_sampler_logprobs
    if not k:
        return None, sets
    best = np.argsort(-top.logprobs, axis=1, kind="stable")[:, :k]  # rows list the sampled token first
    kept = TopLogprobs(
        ids=np.take_along_axis(top.ids, best, axis=1), logprobs=np.take_along_axis(top.logprobs, best, axis=1)
    )
    return kept, sets
