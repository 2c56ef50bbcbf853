"""`token_scores`: what the loss needs from one packed-row forward, differentiable; `token_logprobs` is its
first field.

Owns the forward call (input ids, depths as position ids, the tree plan, the hidden states of only the M
positions `token_index` names, via transformers' `logits_to_keep`; `output_router_logits` when the router
aux loss is asked) and the log-softmax over the vocabulary. When the LM head is a plain linear map
(`_fusable_head`: no softcapping or scaling after it, not an FSDP2 shard), `_HeadGatheredLogSoftmax`
fuses it in: a forward pre-hook hands the head an empty slice and keeps its input, and logits exist only
one chunk of rows (~1 GiB of fp32) at a time, in forward and again (recomputed) in backward, so neither
(M, V) logits nor their gradient are ever materialised (a 16k-term row of a 152k vocabulary saves about
10 GB of bf16 logits and gradient). Otherwise `_GatheredLogSoftmax` works on the model's (M, V) logits,
without an fp32 (M, V) copy. Per chunk, each row's logsumexp is computed once and from it the log-probs
of the target, of the sampler's top-K ids and the logsumexp over the term's sampling set (top-k/top-p
candidates); backward rebuilds softmax chunk by chunk. Does not know the loss (advantages, ratios,
clipping) nor how the row was packed.

Legend: N = packed tokens, M = loss terms, V = vocabulary, K = sampler top-K, C = gathered columns,
S = largest sampling set.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from agrpo_packing import PackedRow

from ._model_patch import _text_config, tree_settings
from ._routing_replay import RowRoutes, routing_replay_settings, row_routes
from ._tree_plan import TreePlan, build_tree_plan

_CHUNK_BYTES = 1 << 28
"""fp32 logits per chunk of the log-softmax over given logits; the fused head takes 4x: each of its chunks
also adds a (V, H) weight-gradient product, which needs rows to be efficient (measured on an H200)."""
_ROUTER_FIELDS = ("num_experts", "num_local_experts", "router_aux_loss_coef")
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
"""Config fields of transformers models that change logits after the LM head, and their no-op values."""


def _chunk_rows(vocab: int, budget: int | None = None) -> int:
    """Rows per chunk: about `budget` (default `_CHUNK_BYTES`) of fp32 logits."""
    return max(1, (_CHUNK_BYTES if budget is None else budget) // (4 * vocab))


def _score_chunk(x, ids, set_ids):
    """x (R, V) tempered fp32 logits -> (lse (R,), gathered (R, C), set logsumexp (R,), 0 for no set)."""
    lse = torch.logsumexp(x, -1)
    gathered = _masked_gather(x, ids) - lse[:, None]
    in_set = torch.logsumexp(_masked_gather(x, set_ids), -1) - lse
    return lse, gathered, torch.where((set_ids >= 0).any(1), in_set, 0.0)


def _chunk_grad(x, ids, set_ids, lse, set_lse, grad, grad_set):
    """d(sum grad * gathered + grad_set * set_lse) / dx for one chunk of tempered logits; x is overwritten."""
    g = torch.where(ids >= 0, grad.to(lse.dtype), 0.0)
    g_set = torch.where((set_ids >= 0).any(1), grad_set.to(lse.dtype), 0.0)
    lse = lse[:, None]
    # d set_lse / dx = renormalised softmax on the set - softmax; d gathered / dx = onehot - softmax
    in_set = torch.exp(_masked_gather(x, set_ids) - lse - set_lse[:, None]) * g_set[:, None]
    grads = x.sub_(lse).exp_().mul_(-(g.sum(1) + g_set)[:, None])
    grads.scatter_add_(1, ids.clamp(min=0), g)
    grads.scatter_add_(1, set_ids.clamp(min=0), in_set)
    return grads


class _GatheredLogSoftmax(torch.autograd.Function):
    """logits (M, V), ids_MC and set_ids_MS (-1 padded) -> log_softmax(logits / T) at ids_MC (M, C), -inf
    at pads, and log of the softmax mass of each row's set (M,), 0 for an empty set. fp32 (fp64 for fp64)."""

    @staticmethod
    def forward(ctx, logits, ids_MC, set_ids_MS, temperature):
        compute = torch.promote_types(logits.dtype, torch.float32)
        num_rows, rows = logits.shape[0], _chunk_rows(logits.shape[1])
        lse_M = logits.new_empty(num_rows, dtype=compute)
        set_lse_M = logits.new_empty(num_rows, dtype=compute)
        gathered_MC = logits.new_empty(ids_MC.shape, dtype=compute)
        for start in range(0, num_rows, rows):
            chunk = slice(start, start + rows)
            x = logits[chunk].to(compute) / temperature
            lse_M[chunk], gathered_MC[chunk], set_lse_M[chunk] = _score_chunk(
                x, ids_MC[chunk], set_ids_MS[chunk]
            )
        ctx.save_for_backward(logits, ids_MC, set_ids_MS, lse_M, set_lse_M)
        ctx.temperature, ctx.rows = temperature, rows
        return gathered_MC, set_lse_M

    @staticmethod
    def backward(ctx, grad_MC, grad_set_M):
        logits, ids_MC, set_ids_MS, lse_M, set_lse_M = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            x = logits[chunk].to(lse_M.dtype) / ctx.temperature  # a fresh chunk: _chunk_grad works in place
            grads = _chunk_grad(x, ids_MC[chunk], set_ids_MS[chunk], lse_M[chunk], set_lse_M[chunk],
                                grad_MC[chunk], grad_set_M[chunk])  # fmt: skip
            grad_logits[chunk] = grads.div_(ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None


class _HeadGatheredLogSoftmax(torch.autograd.Function):
    """The LM head fused in: hidden (M, H), weight (V, H) -> what `_GatheredLogSoftmax` returns for
    logits = hidden @ weight.T computed in `matmul_dtype`, one row chunk at a time in forward and again in
    backward, so no (M, V) logits or logit gradients exist. Gradients to hidden and weight (fp32
    accumulated)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids_MC, set_ids_MS, temperature, matmul_dtype):
        compute = torch.promote_types(matmul_dtype, torch.float32)
        num_rows, rows = hidden.shape[0], _chunk_rows(weight.shape[0], 4 * _CHUNK_BYTES)
        w = weight.to(matmul_dtype)
        lse_M = hidden.new_empty(num_rows, dtype=compute)
        set_lse_M = hidden.new_empty(num_rows, dtype=compute)
        gathered_MC = hidden.new_empty(ids_MC.shape, dtype=compute)
        for start in range(0, num_rows, rows):
            chunk = slice(start, start + rows)
            x = (hidden[chunk].to(matmul_dtype) @ w.T).to(compute) / temperature
            lse_M[chunk], gathered_MC[chunk], set_lse_M[chunk] = _score_chunk(
                x, ids_MC[chunk], set_ids_MS[chunk]
            )
        ctx.save_for_backward(hidden, weight, ids_MC, set_ids_MS, lse_M, set_lse_M)
        ctx.temperature, ctx.rows, ctx.matmul_dtype = temperature, rows, matmul_dtype
        return gathered_MC, set_lse_M

    @staticmethod
    def backward(ctx, grad_MC, grad_set_M):
        hidden, weight, ids_MC, set_ids_MS, lse_M, set_lse_M = ctx.saved_tensors
        dtype = ctx.matmul_dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device)  # fmt: skip
        for start in range(0, hidden.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            h = hidden[chunk].to(dtype)
            x = (h @ w.T).to(lse_M.dtype) / ctx.temperature
            grads = _chunk_grad(x, ids_MC[chunk], set_ids_MS[chunk], lse_M[chunk], set_lse_M[chunk],
                                grad_MC[chunk], grad_set_M[chunk])  # fmt: skip
            grads = grads.div_(ctx.temperature).to(dtype)
            grad_hidden[chunk] = (grads @ w).to(hidden.dtype)
            grad_weight.add_(grads.T @ h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _masked_gather(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x (R, V) at ids (R, C), -inf where the id is -1."""
    return torch.where(ids >= 0, x.gather(1, ids.clamp(min=0)), -torch.inf)


def gathered_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(M, V) logits, (M,) target ids -> (M,) fp32 log-probs of the targets under softmax(logits / T).
    Targets may also be (M, C) ids, -1 padded -> (M, C) log-probs, -inf at the pads."""
    ids_MC = targets[:, None] if targets.ndim == 1 else targets
    no_sets = ids_MC.new_empty(ids_MC.shape[0], 0)
    gathered_MC, _ = _GatheredLogSoftmax.apply(logits, ids_MC, no_sets, float(temperature))
    return gathered_MC[:, 0] if targets.ndim == 1 else gathered_MC


@dataclass(frozen=True, slots=True)
class TokenScores:
    """What `token_scores` returns; every tensor is differentiable w.r.t. the model's parameters."""

    logprobs: torch.Tensor
    """(M,) fp32 log softmax(logits / T) at each loss term's target, over the full vocabulary."""
    top_logprobs: torch.Tensor | None
    """(M, K) fp32, the same at `packed_row.sampler_top_ids`, -inf where the id is -1; None unless asked."""
    candidate_logsumexp: torch.Tensor | None
    """(M,) fp32 logsumexp of the log-probs over each term's sampling set (renormalised log-prob of y =
    logprobs - candidate_logsumexp), 0 for an empty set; None unless asked or the row has no sets."""
    aux_loss: torch.Tensor | None
    """Scalar router load-balancing loss as the model returns it (not multiplied by
    `router_aux_loss_coef`), over the row's N unique tokens; None unless asked."""
    route_matches: torch.Tensor | None = None
    """(2,) int64 when the row carries `routed_experts` and `enable_routing_replay` patched the model (replay
    on or off): [(token, MoE layer) pairs whose live top-k set equals the route, pairs with a route]; the
    route agreement is their ratio. None otherwise. Not differentiable; read it without a per-layer sync."""


def _fusable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head when logits are exactly `head(hidden)`: a plain bias-free `nn.Linear` whose weight is a
    whole tensor (not an FSDP2 shard), and no logit softcapping or scaling after it. Else None: the
    model's own logits are used."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head.weight, "to_local"):
        return None
    config = _text_config(model)
    for name, neutral in _LOGIT_TRANSFORMS.items():
        if getattr(config, name, neutral) not in (None, neutral):
            return None
    return head


def _set_ids(packed_row: PackedRow) -> torch.Tensor:
    """(M, S) int64 ids of each term's sampling set, -1 padded, from the row's flat ids and offsets."""
    offsets = packed_row.sampling_mask_offsets
    sizes = offsets[1:] - offsets[:-1]
    width = int(sizes.max()) if sizes.numel() else 0
    set_ids_MS = torch.full((sizes.shape[0], width), -1, dtype=torch.int64, device=offsets.device)
    terms = torch.repeat_interleave(torch.arange(sizes.shape[0], device=offsets.device), sizes)
    columns = torch.arange(terms.shape[0], device=offsets.device) - offsets[:-1][terms]
    set_ids_MS[terms, columns] = packed_row.sampling_mask_ids.to(torch.int64)
    return set_ids_MS


def _check_requests(model, packed_row: PackedRow, plan: TreePlan | None, top_ids: bool, router: bool):
    settings = tree_settings(model)
    if plan is not None and (
        plan.backend is not settings.backend or (plan.deltanet is None) != (settings.conv_kernel_size is None)
    ):
        raise ValueError(
            "plan was not built for this model: build it with build_tree_plan(packed_row, model)"
        )
    if top_ids and packed_row.sampler_top_ids is None:
        raise ValueError(
            "top_ids=True but the row has no sampler_top_ids: pack samples that carry sampler top "
            "log-probs, or pass top_ids=False"
        )
    config = _text_config(model)
    if router and not any(getattr(config, name, None) for name in _ROUTER_FIELDS):
        raise ValueError(
            f"router_aux_loss=True but {type(model).__name__} has no router (its config sets none of "
            f"{list(_ROUTER_FIELDS)}): the router aux loss applies to mixture-of-experts models only; "
            "pass router_aux_loss=False (leave the trainer's router_aux_loss_coef unset)"
        )
    return settings


_warned_unpatched_routes = False
_warned_missing_routes = False


def _warn_missing_routes() -> None:
    global _warned_missing_routes
    if not _warned_missing_routes:
        _warned_missing_routes = True
        warnings.warn(
            "routing replay is on but a row carries no routed_experts, so its tokens route live: ask the "
            "server for the routed experts of each sample (the rollout's routed-experts option)",
            RuntimeWarning,
            stacklevel=4,
        )


def _row_routes(model, packed_row: PackedRow, device) -> RowRoutes | None:
    """The row's checked routes on `device` when it carries some and the model was patched; warns once when
    a row carries routes the model cannot use (never patched by `enable_routing_replay`), and once when a
    replaying model trains on a row without routes (evaluation forwards, such as a parity probe, do not warn)."""
    global _warned_unpatched_routes
    settings = routing_replay_settings(model)
    if packed_row.routed_experts is None:
        if settings is not None and settings.replay and model.training and torch.is_grad_enabled():
            _warn_missing_routes()
        return None
    if settings is None:
        if not _warned_unpatched_routes:
            _warned_unpatched_routes = True
            warnings.warn(
                "the row carries routed_experts but the model routes live without measuring them: call "
                "enable_routing_replay(model) (replay=False to only measure route agreement)",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return row_routes(settings, packed_row.routed_experts, packed_row.num_tokens, device)


def _empty_scores(model, packed_row: PackedRow, top_ids: bool, with_sets: bool, router: bool) -> TokenScores:
    """Zero-sized outputs of a row without loss terms, still attached to the graph (zero gradients)."""
    anchor = next(model.parameters())
    if hasattr(anchor, "to_local"):  # an FSDP2 shard (DTensor): the local part, so outputs are plain tensors
        anchor = anchor.to_local()
    zero = anchor.flatten()[:1].float().sum() * 0
    width = packed_row.sampler_top_ids.shape[1] if top_ids else 0
    return TokenScores(
        logprobs=anchor.new_zeros(0, dtype=torch.float32) + zero,
        top_logprobs=anchor.new_zeros(0, width, dtype=torch.float32) + zero if top_ids else None,
        candidate_logsumexp=anchor.new_zeros(0, dtype=torch.float32) + zero if with_sets else None,
        aux_loss=zero if router else None,
    )


def _forward(model, head, packed_row: PackedRow, plan: TreePlan, device, router_aux_loss: bool,
             routes: RowRoutes | None):  # fmt: skip
    """(model output, (M, H) LM-head input or None). With a fusable `head`, a pre-hook keeps the head's
    input and hands it an empty slice, so the model builds no logits. `routes` reach the MoE layers as the
    forward kwarg `moe_routes` (`_routing_replay`)."""
    kept: list[torch.Tensor] = []
    hook = None
    if head is not None:
        hook = head.register_forward_pre_hook(lambda _, args: kept.append(args[0]) or (args[0][:, :0],))
    try:
        output = model(
            input_ids=packed_row.input_ids.to(device)[None],
            position_ids=packed_row.position_ids.to(device)[None],
            use_cache=False,
            logits_to_keep=packed_row.token_index.to(device),
            tree_plan=plan,
            **({"output_router_logits": True} if router_aux_loss else {}),
            **({"moe_routes": routes} if routes is not None else {}),
        )
    finally:
        if hook is not None:
            hook.remove()
    return output, (kept[0][0] if kept else None)


def token_scores(
    model: torch.nn.Module,
    packed_row: PackedRow,
    *,
    temperature: float = 1.0,
    top_ids: bool = False,
    candidate_sets: bool = False,
    router_aux_loss: bool = False,
    plan: TreePlan | None = None,
) -> TokenScores:
    """Score every loss term of `packed_row` (aligned with `packed_row.token_index`) under `model`, which
    `enable_tree_attention` switched to tree attention, in one forward. `temperature` divides the logits
    (match the sampler's). `top_ids`: also the log-probs of `packed_row.sampler_top_ids` (the row must
    carry them). `candidate_sets`: also the logsumexp over each term's sampling set, when the row carries
    sampling masks. `router_aux_loss`: also the MoE router aux loss (ValueError on a model without
    router). `plan`: a prebuilt `build_tree_plan(packed_row, model)`. A data-parallel wrapper that keeps the
    model as `.module` (DDP) is called for the forward (its gradient hooks) and looked through otherwise."""
    inner = (
        model.module if isinstance(getattr(model, "module", None), torch.nn.Module) else model
    )  # DDP wraps
    settings = _check_requests(inner, packed_row, plan, top_ids, router_aux_loss)
    with_sets = candidate_sets and packed_row.sampling_mask_offsets is not None
    if packed_row.num_loss_terms == 0:  # nothing to score (e.g. only untrained samples): skip the forward
        return _empty_scores(model, packed_row, top_ids, with_sets, router_aux_loss)
    device = settings.device
    plan = build_tree_plan(packed_row, inner) if plan is None else plan
    head = _fusable_head(inner)
    routes = _row_routes(inner, packed_row, device)
    output, hidden = _forward(model, head, packed_row, plan, device, router_aux_loss, routes)
    ids_MC = packed_row.targets.to(device)[:, None]
    if top_ids:
        ids_MC = torch.cat([ids_MC, packed_row.sampler_top_ids.to(device)], 1)
    set_ids_MS = _set_ids(packed_row).to(device) if with_sets else ids_MC.new_empty(ids_MC.shape[0], 0)
    if head is not None:
        matmul_dtype = (
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type)
            else torch.promote_types(hidden.dtype, head.weight.dtype)
        )
        gathered_MC, set_lse_M = _HeadGatheredLogSoftmax.apply(
            hidden, head.weight, ids_MC, set_ids_MS, float(temperature), matmul_dtype
        )
    else:
        gathered_MC, set_lse_M = _GatheredLogSoftmax.apply(
            output.logits[0], ids_MC, set_ids_MS, float(temperature)
        )
    aux_loss = output.aux_loss if router_aux_loss else None
    if router_aux_loss and not isinstance(aux_loss, torch.Tensor):
        raise ValueError(
            f"{type(model).__name__} returned no aux_loss with output_router_logits=True; "
            "pass router_aux_loss=False for this model"
        )
    return TokenScores(
        logprobs=gathered_MC[:, 0],
        top_logprobs=gathered_MC[:, 1:] if top_ids else None,
        candidate_logsumexp=set_lse_M if with_sets else None,
        aux_loss=aux_loss,
        route_matches=routes.agreement_counts() if routes is not None else None,
    )


def token_logprobs(
    model: torch.nn.Module,
    packed_row: PackedRow,
    *,
    temperature: float = 1.0,
    plan: TreePlan | None = None,
) -> torch.Tensor:
    """(M,) fp32 log-prob of each loss term's target (aligned with `packed_row.token_index`) under
    `model`, which `enable_tree_attention` switched to tree attention. Differentiable. `temperature`
    divides the logits (match the sampler's). `plan`: a prebuilt `build_tree_plan(packed_row, model)`.
    The first field of `token_scores`."""
    return token_scores(model, packed_row, temperature=temperature, plan=plan).logprobs
