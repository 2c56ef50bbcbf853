"""`token_logprobs`: the differentiable log-prob of every loss term's target, from one packed-row forward.

Owns the forward call (input ids, depths as position ids, the tree plan, logits only at the M
positions `token_index` names, via transformers' `logits_to_keep`) and `gathered_logprobs`, an
autograd function that turns (M, V) logits into M log-probs without an fp32 (M, V) copy: it streams
row chunks of ~256 MiB through logsumexp in forward and rebuilds softmax chunk by chunk in backward.
Does not know the loss (advantages, clipping) nor how the row was packed.

Legend: N = packed tokens, M = loss terms, V = vocabulary.
"""

from __future__ import annotations

import torch

from agrpo_packing import PackedRow

from ._model_patch import tree_settings
from ._tree_plan import TreePlan, build_tree_plan

_CHUNK_BYTES = 1 << 28


class _GatheredLogSoftmax(torch.autograd.Function):
    """logits (M, V), targets (M,) -> log_softmax(logits / temperature)[m, targets[m]], fp32 (fp64 for fp64)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature):
        compute = torch.promote_types(logits.dtype, torch.float32)
        rows = max(1, _CHUNK_BYTES // (4 * logits.shape[1]))
        lse = torch.empty(logits.shape[0], dtype=compute, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            lse[start : start + rows] = torch.logsumexp(
                logits[start : start + rows].to(compute) / temperature, -1
            )
        picked = logits.gather(1, targets[:, None])[:, 0].to(compute) / temperature
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            g = grad[start:stop, None].to(lse.dtype)
            probs = torch.exp(logits[start:stop].to(lse.dtype) / ctx.temperature - lse[start:stop, None])
            chunk = -probs * g
            chunk.scatter_add_(1, targets[start:stop, None], g)
            grad_logits[start:stop] = (chunk / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None


def gathered_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(M, V) logits, (M,) target ids -> (M,) fp32 log-probs of the targets under softmax(logits / T)."""
    return _GatheredLogSoftmax.apply(logits, targets, float(temperature))


def token_logprobs(
    model: torch.nn.Module,
    packed_row: PackedRow,
    *,
    temperature: float = 1.0,
    plan: TreePlan | None = None,
) -> torch.Tensor:
    """(M,) fp32 log-prob of each loss term's target (aligned with `packed_row.token_index`) under
    `model`, which `enable_tree_attention` switched to tree attention. Differentiable. `temperature`
    divides the logits (match the sampler's). `plan`: a prebuilt `build_tree_plan(packed_row, model)`."""
    settings = tree_settings(model)
    if packed_row.num_loss_terms == 0:  # nothing to score (e.g. only untrained samples): skip the forward
        anchor = next(model.parameters())
        return anchor.new_zeros(0, dtype=torch.float32) * anchor.flatten()[:1].float()  # still differentiable
    if plan is None:
        plan = build_tree_plan(packed_row, model)
    elif plan.backend is not settings.backend or (plan.deltanet is None) != (
        settings.conv_kernel_size is None
    ):
        raise ValueError(
            "plan was not built for this model: build it with build_tree_plan(packed_row, model)"
        )
    device = settings.device
    token_index = packed_row.token_index.to(device)
    output = model(
        input_ids=packed_row.input_ids.to(device)[None],
        position_ids=packed_row.position_ids.to(device)[None],
        use_cache=False,
        logits_to_keep=token_index,
        tree_plan=plan,
    )
    return gathered_logprobs(output.logits[0], packed_row.targets.to(device), temperature)
