"""`grpo_loss`: the GRPO objective of one row's loss terms (SPEC F-LOSS), and `LossStats`, its metrics.

Owns the per-token math: importance ratios against the sampler (renormalised over each token's
top-k/top-p candidate set when given), masked importance sampling, the clipped surrogate, score
centering, and statistics that add up across micro-batches and ranks. Pure: tensors in, a summed loss
and statistics out; it never logs. Does not know the model or its forward (agrpo-attention's
`token_scores` gives the policy inputs), the router aux loss, the normalisation over an optimizer step
(the caller divides `loss_sum` by the step's trained tokens over all micro-batches and ranks), nor how
statistics are all-reduced (`LossStats.to_tensors` / `from_tensors` hand them over).

Per term, r = exp(logp - logq) (policy vs sampler, both normalised over the sampler's candidate set):
the loss is -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) when is_clip_min <= r <= is_clip_max,
else 0 (the token is masked out).

Score centering. For y ~ mu with advantage A, the gradient of that loss is -A r grad log pi(y) =
-A grad pi(y) / mu(y) when y is in the set U of in-bounds, unclipped tokens (A > 0: r <= 1 +
epsilon_high; A < 0: r >= 1 - epsilon), else 0. Its expectation under mu is -A sum_{y in U} grad pi(y),
which is not zero even for a constant advantage (only the sum over the whole vocabulary is): masking
and clipping make a constant advantage pull pi toward (or away from) the sampler. Every term therefore
adds A sum_{k in S} pi(k), S = the sampler's top-K ids that the same rule puts in U (own ratio
r_k = exp(logp_k - logq_k) in bounds and unclipped for the sign of A). That term does not depend on y,
so the expected gradient becomes -A sum_{y in U \\ S} grad pi(y): zero when the top-K covers U, else
minus the gradient of the policy mass of U outside the top-K. It enters as x - x.detach(), so
`loss_sum`'s value stays the clipped surrogate's; only the gradient changes.

Legend: M = loss terms of one row, K = sampler top-K (-1 padded ids have -inf log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SUMS = (
    "num_terms",
    "num_masked",
    "ratio_sum",
    "logp_difference_sum",
    "kl_sum",
    "num_clipped_low",
    "num_clipped_high",
    "num_top_terms",
    "sampler_mass_sum",
    "num_route_matches",
    "num_routes",
)
_MAXIMA = ("ratio_max", "logp_difference_max", "negated_ratio_min")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSettings:
    """The loss's knobs (the trainer maps its config onto these)."""

    epsilon: float
    """Clip low: the ratio is clipped at 1 - epsilon; in [0, 1)."""
    epsilon_high: float
    """Clip high: the ratio is clipped at 1 + epsilon_high; >= 0."""
    is_clip_min: float
    """Masked importance sampling: terms with ratio below this are dropped (vllm_importance_sampling_clip_min); >= 0."""
    is_clip_max: float
    """Terms with ratio above this are dropped (vllm_importance_sampling_clip_max); >= is_clip_min."""
    score_centering: bool
    """Subtract the sampler-expected score over its top-K ids; needs the top-K inputs (else no effect)."""

    def __post_init__(self) -> None:
        if not 0 <= self.epsilon < 1 or self.epsilon_high < 0:
            raise ValueError(
                f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: set epsilon in [0, 1) and "
                "epsilon_high >= 0"
            )
        if not 0 <= self.is_clip_min <= self.is_clip_max:
            raise ValueError(
                f"importance sampling bounds [{self.is_clip_min}, {self.is_clip_max}] are empty or negative: set "
                "0 <= vllm_importance_sampling_clip_min <= vllm_importance_sampling_clip_max"
            )


@dataclass(kw_only=True, slots=True)
class LossInputs:
    """One row's loss terms; every tensor on the same device."""

    policy_logprobs: torch.Tensor
    """(M,) fp32 log pi_theta(y) over the full vocabulary, differentiable."""
    sampler_logprobs: torch.Tensor
    """(M,) log mu(y) as the sampler reported it (after its top-k/top-p)."""
    advantages: torch.Tensor
    """(M,)."""
    policy_top_logprobs: torch.Tensor | None = None
    """(M, K) log pi_theta of the sampler's top-K ids (full vocabulary), differentiable, -inf pads."""
    sampler_top_logprobs: torch.Tensor | None = None
    """(M, K) log mu of the same ids, -inf pads; given together with `policy_top_logprobs`."""
    candidate_logsumexp: torch.Tensor | None = None
    """(M,) logsumexp of pi_theta's log-probs over each term's sampling set (0: no renormalisation)."""


@dataclass(kw_only=True, slots=True)
class LossStats:
    """Additive statistics: `sums` add and `maxima` take the max across micro-batches and ranks (the
    ratio's minimum is kept negated among the maxima). Float64 tensors on the loss's device; nothing is
    read back to the host until `metrics`. Ratios and KL cover every term, masked ones included, so a
    term with an infinite ratio makes their mean infinite."""

    sums: torch.Tensor
    """(len(_SUMS),) counts and sums, named in `_SUMS`."""
    maxima: torch.Tensor
    """(len(_MAXIMA),) maxima, named in `_MAXIMA`."""

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> LossStats:
        """No terms: the identity of `merge`."""
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        return cls(sums=sums, maxima=torch.full_like(sums[: len(_MAXIMA)], -torch.inf))

    def merge(self, other: LossStats) -> LossStats:
        """Statistics of both sets of terms (on `other`'s device when self's is the CPU)."""
        device = other.sums.device if self.sums.device.type == "cpu" else self.sums.device
        return LossStats(
            sums=self.sums.to(device) + other.sums.to(device),
            maxima=torch.maximum(self.maxima.to(device), other.maxima.to(device)),
        )

    def with_routes(self, route_matches: torch.Tensor) -> LossStats:
        """These statistics plus a row's MoE route counts (`TokenScores.route_matches`: tokens x MoE layers
        whose live top-k equals the sampler's route, and those with a route)."""
        routes = torch.zeros_like(self.sums)
        first = _SUMS.index("num_route_matches")
        routes[first : first + 2] = route_matches.to(routes)
        return LossStats(sums=self.sums + routes, maxima=self.maxima)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, maxima): all-reduce the first with SUM and the second with MAX, then `from_tensors`."""
        return self.sums, self.maxima

    @classmethod
    def from_tensors(cls, sums: torch.Tensor, maxima: torch.Tensor) -> LossStats:
        return cls(sums=sums, maxima=maxima)

    def metrics(self) -> dict[str, float]:
        """Means over the terms (0 when there are none, and so are the min/max), in the trainer's names."""
        s = dict(zip(_SUMS, self.sums.tolist(), strict=True))
        x = {k: (v if v > -torch.inf else 0.0) for k, v in zip(_MAXIMA, self.maxima.tolist(), strict=True)}
        n = max(s["num_terms"], 1.0)
        out = {
            "num_terms": s["num_terms"],
            "sampling/masked_mean": s["num_masked"] / n,
            "sampling/importance_sampling_ratio/mean": s["ratio_sum"] / n,
            "sampling/importance_sampling_ratio/min": -x["negated_ratio_min"],
            "sampling/importance_sampling_ratio/max": x["ratio_max"],
            "sampling/sampling_logp_difference/mean": s["logp_difference_sum"] / n,
            "sampling/sampling_logp_difference/max": x["logp_difference_max"],
            "clip_ratio/low_mean": s["num_clipped_low"] / n,
            "clip_ratio/high_mean": s["num_clipped_high"] / n,
            "clip_ratio/region_mean": (s["num_clipped_low"] + s["num_clipped_high"]) / n,
            "kl": s["kl_sum"] / n,
        }
        if s["num_top_terms"] > 0:
            out["sampling/sampler_mass"] = s["sampler_mass_sum"] / s["num_top_terms"]
        if s["num_routes"] > 0:
            out["moe/route_agreement"] = s["num_route_matches"] / s["num_routes"]
        return out


@dataclass(kw_only=True, slots=True)
class LossOutputs:
    """What `grpo_loss` returns for one row."""

    loss_sum: torch.Tensor
    """Scalar: the sum over the M terms of the per-token loss."""
    stats: LossStats
    """This row's statistics."""


def _within_bounds(ratio: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    return (ratio >= settings.is_clip_min) & (ratio <= settings.is_clip_max)


def _unclipped(ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """Where min(r A, clip(r) A) passes r's gradient: A > 0 and r <= 1 + epsilon_high, or A < 0 and
    r >= 1 - epsilon."""
    return ((advantages > 0) & (ratio <= 1 + settings.epsilon_high)) | (
        (advantages < 0) & (ratio >= 1 - settings.epsilon)
    )


def _clipped_surrogate(
    log_ratio_M: torch.Tensor, advantages_M: torch.Tensor, in_bounds_M: torch.Tensor, settings: LossSettings
) -> torch.Tensor:
    """(M,) -min(r A, clip(r) A) on in-bounds terms, 0 (and no gradient, even for r = inf) elsewhere."""
    ratio_M = torch.exp(torch.where(in_bounds_M, log_ratio_M, 0.0))
    clipped_M = ratio_M.clamp(1 - settings.epsilon, 1 + settings.epsilon_high)
    per_term_M = -torch.minimum(ratio_M * advantages_M, clipped_M * advantages_M)
    return torch.where(in_bounds_M, per_term_M, 0.0)


def _score_centering(
    policy_top_MK: torch.Tensor,
    sampler_top_MK: torch.Tensor,
    advantages_M: torch.Tensor,
    settings: LossSettings,
) -> torch.Tensor:
    """(M,) A sum_{k in S} pi(k), minus its own value: the expected-score correction (module docstring)."""
    valid_MK = torch.isfinite(sampler_top_MK) & torch.isfinite(policy_top_MK)
    ratio_MK = torch.where(valid_MK, policy_top_MK.detach() - sampler_top_MK, 0.0).exp()
    kept_MK = (
        valid_MK & _within_bounds(ratio_MK, settings) & _unclipped(ratio_MK, advantages_M[:, None], settings)
    )
    mass_M = torch.where(kept_MK, policy_top_MK, -torch.inf).exp().sum(1)
    return advantages_M * (mass_M - mass_M.detach())


def _statistics(
    log_ratio_M: torch.Tensor,
    advantages_M: torch.Tensor,
    in_bounds_M: torch.Tensor,
    sampler_top_MK: torch.Tensor | None,
    settings: LossSettings,
) -> LossStats:
    """Detached sums and maxima over all M terms (ratios and KL include the masked terms)."""
    log_ratio_M = log_ratio_M.detach().double()
    ratio_M = log_ratio_M.exp()
    low_M = in_bounds_M & (advantages_M < 0) & (ratio_M < 1 - settings.epsilon)
    high_M = in_bounds_M & (advantages_M > 0) & (ratio_M > 1 + settings.epsilon_high)
    has_top = sampler_top_MK is not None
    mass = sampler_top_MK.double().exp().sum() if has_top else ratio_M.new_zeros(())
    sums = [
        ratio_M.new_tensor(float(ratio_M.numel())),
        (~in_bounds_M).sum(),
        ratio_M.sum(),
        log_ratio_M.abs().sum(),
        (ratio_M - 1 - log_ratio_M).sum(),  # k3 estimator of KL(mu || pi)
        low_M.sum(),
        high_M.sum(),
        ratio_M.new_tensor(float(ratio_M.numel() if has_top else 0)),
        mass,
        ratio_M.new_zeros(()),  # MoE route counts: `with_routes`
        ratio_M.new_zeros(()),
    ]
    empty = ratio_M.new_tensor(-torch.inf)
    maxima = [
        torch.cat([empty[None], ratio_M]).max(),
        torch.cat([empty[None], log_ratio_M.abs()]).max(),
        torch.cat([empty[None], -ratio_M]).max(),
    ]
    return LossStats(sums=torch.stack(sums).double(), maxima=torch.stack(maxima))


def _check_inputs(inputs: LossInputs) -> None:
    if (inputs.policy_top_logprobs is None) != (inputs.sampler_top_logprobs is None):
        raise ValueError(
            "policy_top_logprobs and sampler_top_logprobs come together: pass both (score centering) or neither"
        )
    num_terms = inputs.policy_logprobs.shape
    assert inputs.sampler_logprobs.shape == num_terms and inputs.advantages.shape == num_terms
    if inputs.policy_top_logprobs is not None:
        assert inputs.policy_top_logprobs.shape == inputs.sampler_top_logprobs.shape
        assert inputs.policy_top_logprobs.shape[:1] == num_terms
    assert inputs.candidate_logsumexp is None or inputs.candidate_logsumexp.shape == num_terms


def grpo_loss(inputs: LossInputs, settings: LossSettings) -> LossOutputs:
    """The summed per-token GRPO loss of one row's terms and their statistics (module docstring)."""
    _check_inputs(inputs)
    logp_M, policy_top_MK = inputs.policy_logprobs, inputs.policy_top_logprobs
    if inputs.candidate_logsumexp is not None:  # renormalise over each term's sampling set
        logp_M = logp_M - inputs.candidate_logsumexp
        if policy_top_MK is not None:
            policy_top_MK = policy_top_MK - inputs.candidate_logsumexp[:, None]
    log_ratio_M = logp_M - inputs.sampler_logprobs
    in_bounds_M = _within_bounds(log_ratio_M.detach().exp(), settings)
    per_term_M = _clipped_surrogate(log_ratio_M, inputs.advantages, in_bounds_M, settings)
    if settings.score_centering and policy_top_MK is not None:
        per_term_M = per_term_M + _score_centering(
            policy_top_MK, inputs.sampler_top_logprobs, inputs.advantages, settings
        )
    stats = _statistics(log_ratio_M, inputs.advantages, in_bounds_M, inputs.sampler_top_logprobs, settings)
    return LossOutputs(loss_sum=per_term_M.sum(), stats=stats)
