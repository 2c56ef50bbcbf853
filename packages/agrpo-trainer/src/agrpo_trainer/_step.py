"""The loss of one rank's row in one micro-batch, scaled so that a whole optimizer step is a token mean.

Owns the call into agrpo-attention (`token_scores`: the policy's log-probs of each trained token, of the
sampler's top-K ids when score centering needs them, the candidate-set normaliser when the row carries
sampling masks, the MoE router loss when asked, the MoE route counts when the row carries the sampler's
routes, replayed or only measured as `routing_replay` patched the model at construction, added to the
statistics) and the scaling of `grpo_loss`'s sum. Normalisation (SPEC F-LOSS): every trained token of the
optimizer step weighs the same, whichever micro-batch or rank it landed in. The trainer counts the step's
trained tokens over all micro-batches and ranks (`N`) before the first backward; each row's loss is
`sum / N * world_size`, because data-parallel gradient reduction averages over ranks. The router loss is a
per-forward mean, so it is divided by the number of micro-batches in the step.

Does not know where rows come from, optimizers or logging.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from agrpo_attention import TreePlan, token_scores
from agrpo_packing import PackedRow, TreeRow

from ._loss import LossInputs, LossSettings, LossStats, grpo_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSettings:
    """What the micro-batch loss needs besides the row."""

    loss: LossSettings
    temperature: float
    router_aux_loss_coef: float
    """0 disables the router loss (non-MoE models)."""
    truncated_sampling: bool
    """top_k/top_p/min_p restrict the sampler's candidate set, so log-probs are renormalised over it."""


_warned_vocabulary_fallback = False


def _warn_vocabulary_fallback() -> None:
    global _warned_vocabulary_fallback
    if not _warned_vocabulary_fallback:
        _warned_vocabulary_fallback = True
        warnings.warn(
            "top_k/top_p truncate the sampler's candidate set, but the server returned no sampling masks, so the "
            "trainer normalises over the whole vocabulary and importance ratios are biased low by the kept mass. "
            "Start vLLM (>= 0.28) with --return-sampling-mask --enable-scale-out to renormalise exactly",
            RuntimeWarning,
            stacklevel=3,
        )


def placeholder_row(token_id: int = 0) -> PackedRow:
    """A two-token row with one loss term: an empty rank forwards it (scaled by 0) so collectives line up."""
    from agrpo_packing import PackSample

    row = TreeRow(0)
    row.add(
        PackSample(
            input_ids=[token_id, token_id],
            trained_mask=[False, True],
            group_id=-1,
            advantages=[0.0],
            sampler_logprobs=[0.0],
        )
    )
    return row.pack()


def micro_batch_loss(
    model: torch.nn.Module,
    row: PackedRow,
    settings: StepSettings,
    *,
    step_trained_tokens: int,
    world_size: int,
    micro_batches_per_step: int,
    plan: TreePlan | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This rank's scaled loss for `row` and its statistics. An empty row on a multi-rank run still runs a
    forward (of a placeholder, weighted 0) so every rank joins the same gradient collectives. `row` may be
    on the host or already on the model's device (a `DeviceRow`'s), `plan` its prebuilt tree plan."""
    weight = 1.0
    if row.num_loss_terms == 0 and world_size > 1:
        row, weight, plan = placeholder_row(), 0.0, None
    want_top = settings.loss.score_centering and row.sampler_top_ids is not None
    has_sets = row.sampling_mask_ids is not None
    if settings.truncated_sampling and not has_sets and row.num_loss_terms:
        _warn_vocabulary_fallback()
    scores = token_scores(
        model,
        row,
        temperature=settings.temperature,
        top_ids=want_top,
        candidate_sets=has_sets,
        router_aux_loss=settings.router_aux_loss_coef > 0,
        plan=plan,
    )
    device = scores.logprobs.device
    out = grpo_loss(
        LossInputs(
            policy_logprobs=scores.logprobs,
            sampler_logprobs=row.sampler_logprobs.to(device),
            advantages=row.advantages.to(device),
            policy_top_logprobs=scores.top_logprobs,
            sampler_top_logprobs=row.sampler_top_logprobs.to(device) if want_top else None,
            candidate_logsumexp=scores.candidate_logsumexp,
        ),
        settings.loss,
    )
    loss = out.loss_sum * (weight * world_size / max(step_trained_tokens, 1))
    if settings.router_aux_loss_coef > 0 and scores.aux_loss is not None:
        loss = loss + weight * settings.router_aux_loss_coef * scores.aux_loss / micro_batches_per_step
    stats = out.stats if weight else LossStats.empty()
    if weight and scores.route_matches is not None:  # rows that carry the sampler's MoE routes
        stats = stats.with_routes(scores.route_matches)
    return loss, stats
