"""`enable_routing_replay`: MoE layers that route each token to the experts the sampler used (routing replay,
"R3"), and the route agreement measured on every forward that carries routes.

Why: an inference engine and the trainer route a token to different experts (different kernels, batch
shapes and precision flip near-tied router logits), so an importance ratio would measure routing noise.
Replay trains on the sampler's experts: the top-k *ids* come from `PackedRow.routed_experts`, the gate
*weights* are recomputed from the live router logits at those ids by the model's own formula (softmax
over all experts, gather, renormalise where the model does, the model's dtype; gpt-oss: softmax over the
chosen ids' logits only, which include the router's bias), so the router keeps its gradient, and replaying
the model's own routes is bit-identical to live routing. Tokens without a route (-1: the last sampled token,
prompt tokens the server skipped) route live.

How routes reach each layer, so that activation recompute and `torch.compile` see the same experts:
`token_scores` passes a `RowRoutes` as the model's forward kwarg `moe_routes`; transformers hands forward
kwargs to every decoder layer; a forward pre-hook on each decoder layer turns it into that layer's own
(N, k) routes and (2,) counter, as kwargs (`layer_routes`, `layer_route_counts`). The MoE layers' class is
swapped (per instance, like FSDP2's) for a subclass whose `forward` takes those kwargs and runs the
layer's own forward under `torch.func.functional_call` with them swapped into two non-persistent buffers
of the router. Being forward arguments, they are saved by any checkpoint and given again to the recompute;
inside a compiled layer they are graph inputs (no setattr in the graph, no guard on a layer index: the
pre-hook slices eagerly). The patched router calls its class's forward (live logits, weights and top-k),
writes into the counter how many routed tokens have a live top-k set equal to the route, and, with
replay, swaps in the replayed ids and their recomputed weights. Cost per MoE layer and row: a second
softmax over (N, E) logits (gpt-oss: over (N, k)), two sorts of (N, k) ids, a gather (measured in
docs/benchmarks.md).

Does not know where routes come from (vLLM, the rollout) nor the loss; `token_scores` checks the row's
routes against the model (`row_routes`) once per row.

Legend: N = packed tokens, L = decoder layers (`num_hidden_layers`), K = experts per token (top-k),
E = experts.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

import torch

from ._exceptions import UnsupportedModelError

_SETTINGS_ATTRIBUTE = "_agrpo_routing_replay"
_ROUTES_BUFFER = "agrpo_routes"
_COUNTS_BUFFER = "agrpo_route_counts"
_REPLAY_FLAG = "agrpo_replay"


@dataclass(frozen=True, slots=True)
class _GateRule:
    """How one router class turns softmax probabilities at the chosen ids into gate weights."""

    renormalise: str | None
    """Router attribute that says whether the top-k weights are renormalised; None: always."""
    to_logit_dtype: bool
    """The weights are cast back to the router logits' dtype (Mixtral keeps them in fp32)."""
    top_k_softmax: bool = False
    """The softmax runs over the chosen ids' logits only, in the logits' dtype (gpt-oss: top-k of the logits,
    then softmax): mathematically softmax-gather-renormalise, computed as the model computes it."""


_GATE_RULES = {
    "Qwen3MoeTopKRouter": _GateRule("norm_topk_prob", True),
    "OlmoeTopKRouter": _GateRule("norm_topk_prob", True),
    "Qwen3NextTopKRouter": _GateRule("norm_topk_prob", True),
    "MixtralTopKRouter": _GateRule(None, False),
    "GptOssTopKRouter": _GateRule(None, True, top_k_softmax=True),
}
"""The transformers (5.24) routers replay supports: they return (router_logits, weights, top-k ids)."""
SUPPORTED_MOE_BLOCKS = (
    "Qwen3MoeSparseMoeBlock",
    "OlmoeSparseMoeBlock",
    "MixtralSparseMoeBlock",
    "Qwen3NextSparseMoeBlock",
    "GptOssMLP",
)
_ROUTER_ATTRIBUTES = ("gate", "router")
"""Where a MoE block keeps its router: `gate`, or `router` (gpt-oss)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingReplaySettings:
    """What `enable_routing_replay` found and chose for one model."""

    replay: bool
    """True: MoE layers use the row's routes; False: they route live and only measure agreement."""
    moe_layers: tuple[int, ...]
    """Indices (among `num_hidden_layers`) of the decoder layers with a MoE block."""
    num_layers: int
    """`num_hidden_layers`: the routes' second dimension."""
    top_k: int
    """Experts per token: the routes' third dimension."""
    num_experts: int
    """Routed experts per MoE layer; ids must lie in [0, num_experts)."""


@dataclass(slots=True)
class RowRoutes:
    """One row's routes on the model's device, handed to the forward as `moe_routes`, and the per-layer
    counters the MoE layers fill (tokens whose live top-k equals the route, tokens with a route)."""

    routes_NLK: torch.Tensor
    """(N, L, K) int64, -1 for tokens without a route."""
    counts: list[torch.Tensor] = field(default_factory=list)
    """(2,) int64 per MoE layer forwarded so far."""

    def layer_kwargs(self, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The kwargs of decoder layer `layer`: its own contiguous (N, K) routes and a fresh counter."""
        counts = torch.zeros(2, dtype=torch.int64, device=device)
        self.counts.append(counts)
        return {"layer_routes": self.routes_NLK[:, layer].contiguous(), "layer_route_counts": counts}

    def agreement_counts(self) -> torch.Tensor:
        """(2,) int64 summed over MoE layers: [(token, layer) pairs whose live top-k set equals the route,
        pairs with a route]. No host sync."""
        return torch.stack(self.counts).sum(0)


def _replay_router_forward(self, hidden_states):
    """Forward of a patched router: the class's own, then (with routes) the agreement count and, with
    replay, the routed ids and their gate weights recomputed from the live logits."""
    logits, weights, live_NK = type(self).forward(self, hidden_states)
    routes_NK = getattr(self, _ROUTES_BUFFER)
    if routes_NK.shape[0] == 0:  # the default buffer: no routes for this forward
        return logits, weights, live_NK
    routed_N = routes_NK[:, 0] >= 0
    with torch.no_grad():
        same_N = (routes_NK.sort(-1).values == live_NK.sort(-1).values).all(-1) & routed_N
        getattr(self, _COUNTS_BUFFER).copy_(torch.stack([same_N.sum(), routed_N.sum()]))
    if not getattr(self, _REPLAY_FLAG):
        return logits, weights, live_NK
    experts_NK = torch.where(routed_N[:, None], routes_NK, live_NK)
    rule = _GATE_RULES[type(self).__name__]
    if rule.top_k_softmax:
        chosen = logits.gather(1, experts_NK)
        return logits, torch.nn.functional.softmax(chosen, dim=1, dtype=chosen.dtype), experts_NK
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    chosen = probs.gather(1, experts_NK)
    if rule.renormalise is None or getattr(self, rule.renormalise):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return logits, (chosen.to(logits.dtype) if rule.to_logit_dtype else chosen), experts_NK


class _ClassForward(torch.nn.Module):
    """Calls the stock class forward of `layer` (for `functional_call`, past any instance override such as a
    trainer's compiled region)."""

    def __init__(self, layer: torch.nn.Module, stock: type) -> None:
        super().__init__()
        self.layer, self.stock = layer, stock

    def forward(self, hidden_states, *args, **kwargs):
        return self.stock.forward(self.layer, hidden_states, *args, **kwargs)


@functools.cache
def _replay_layer_class(stock: type) -> type:
    """The subclass a MoE decoder layer of class `stock` is switched to (one per stock class, so that every
    layer of a model shares one compiled graph)."""

    def forward(self, hidden_states, *args, layer_routes=None, layer_route_counts=None, **kwargs):
        if layer_routes is None:
            return stock.forward(self, hidden_states, *args, **kwargs)
        swapped = {
            f"layer.{self.agrpo_router_name}.{_ROUTES_BUFFER}": layer_routes,
            f"layer.{self.agrpo_router_name}.{_COUNTS_BUFFER}": layer_route_counts,
        }
        return torch.func.functional_call(
            self.agrpo_class_forward, swapped, (hidden_states, *args), kwargs, tie_weights=False
        )

    forward.__doc__ = "The stock forward, with this layer's routes (forward kwargs) in its router's buffers."
    return type(f"RoutingReplay{stock.__name__}", (stock,), {"forward": forward})


def _layer_routes_hook(module, args, kwargs, *, layer: int | None):
    """Pre-hook of every decoder layer: `moe_routes` (a RowRoutes) -> this layer's kwargs (none for a dense
    layer). Runs eagerly, outside checkpoints and compiled regions."""
    row_routes = kwargs.pop("moe_routes", None)
    if row_routes is not None and layer is not None:
        kwargs.update(
            row_routes.layer_kwargs(layer, args[0].device if args else kwargs["hidden_states"].device)
        )
    return args, kwargs


def _decoder_layers(model: torch.nn.Module, num_layers: int) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != num_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has {len(layers)} decoder layers but its config says num_hidden_layers="
            f"{num_layers}; routing replay needs one decoder layer per routes column"
        )
    return layers


def _moe_router(layer: torch.nn.Module, index: int) -> tuple[str, torch.nn.Module] | None:
    """(name, router) of the layer's MoE block; None for a dense layer; refuses an unsupported MoE block."""
    for name, module in layer.named_modules():
        attribute = next((a for a in _ROUTER_ATTRIBUTES if hasattr(module, a)), None)
        if not hasattr(module, "experts") or attribute is None:
            continue
        router = getattr(module, attribute)
        if type(module).__name__ not in SUPPORTED_MOE_BLOCKS or type(router).__name__ not in _GATE_RULES:
            raise UnsupportedModelError(
                f"decoder layer {index} has a {type(module).__name__} (router {type(router).__name__}); "
                f"routing replay supports {list(SUPPORTED_MOE_BLOCKS)}: pass routing_replay=False for this model"
            )
        return f"{name}.{attribute}", router
    return None


def _patch_router(router: torch.nn.Module, replay: bool) -> None:
    device = router.weight.device
    router.register_buffer(_ROUTES_BUFFER, torch.zeros(0, router.top_k, dtype=torch.int64, device=device),
                           persistent=False)  # fmt: skip
    router.register_buffer(_COUNTS_BUFFER, torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
    setattr(router, _REPLAY_FLAG, replay)
    # A bound method (not a closure) so that copy.deepcopy(model) rebinds it to the copy's own router.
    router.forward = types.MethodType(_replay_router_forward, router)


def enable_routing_replay(model: torch.nn.Module, *, replay: bool = True) -> RoutingReplaySettings:
    """Patch every MoE layer of `model` (Qwen3-MoE, OLMoE, Mixtral, Qwen3-Next or gpt-oss, transformers 5.24) so that
    `token_scores` hands it the routes of rows that carry `routed_experts`: with `replay`, each routed token
    uses the sampler's experts (gate weights from the live logits, the router keeps its gradient); with
    `replay=False` routing stays live and only the route agreement is measured. Raises
    UnsupportedModelError for a dense model or an unsupported MoE block. Calling it again changes `replay`."""
    from ._model_patch import _text_config

    config = _text_config(model)
    num_layers = int(config.num_hidden_layers)
    previous = routing_replay_settings(model)
    if previous is not None:  # already patched: only the flag changes
        for layer in _decoder_layers(model, num_layers):
            if hasattr(layer, "agrpo_router_name"):
                setattr(layer.get_submodule(layer.agrpo_router_name), _REPLAY_FLAG, replay)
        settings = RoutingReplaySettings(**{**_fields(previous), "replay": replay})
        setattr(model, _SETTINGS_ATTRIBUTE, settings)
        return settings
    layers = _decoder_layers(model, num_layers)
    routers = {i: found for i, layer in enumerate(layers) if (found := _moe_router(layer, i)) is not None}
    if not routers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no mixture-of-experts layer: routing replay applies to MoE models only "
            "(set routing_replay=False)"
        )
    for index, layer in enumerate(layers):
        if index in routers:
            name, router = routers[index]
            stock = type(layer)
            layer.__class__ = _replay_layer_class(stock)
            object.__setattr__(layer, "agrpo_router_name", name)  # plain attributes, not submodules
            object.__setattr__(layer, "agrpo_class_forward", _ClassForward(layer, stock))
            _patch_router(router, replay)
        layer.register_forward_pre_hook(
            functools.partial(_layer_routes_hook, layer=index if index in routers else None), with_kwargs=True
        )
    first = next(iter(routers.values()))[1]
    settings = RoutingReplaySettings(
        replay=replay, moe_layers=tuple(routers), num_layers=num_layers, top_k=int(first.top_k),
        num_experts=int(first.num_experts),
    )  # fmt: skip
    setattr(model, _SETTINGS_ATTRIBUTE, settings)
    return settings


def _fields(settings: RoutingReplaySettings) -> dict:
    return {name: getattr(settings, name) for name in RoutingReplaySettings.__slots__}


def routing_replay_settings(model: torch.nn.Module) -> RoutingReplaySettings | None:
    """What `enable_routing_replay` recorded on `model` (looking through a DDP `.module`); None if never called."""
    settings = getattr(model, _SETTINGS_ATTRIBUTE, None)
    inner = getattr(model, "module", None)
    if settings is None and isinstance(inner, torch.nn.Module):
        settings = getattr(inner, _SETTINGS_ATTRIBUTE, None)
    return settings


def row_routes(settings: RoutingReplaySettings, routed_experts: torch.Tensor, num_tokens: int,
               device: torch.device) -> RowRoutes:  # fmt: skip
    """The row's `routed_experts` checked against the model and moved to `device` as int64. One host sync
    (the value checks), once per row. Columns of dense layers are ignored."""
    expected = (num_tokens, settings.num_layers, settings.top_k)
    if tuple(routed_experts.shape) != expected:
        raise ValueError(
            f"packed_row.routed_experts has shape {tuple(routed_experts.shape)}, expected (N, num_hidden_layers, "
            f"top_k) = {expected}: the server's routes must come from this model (same layers and "
            "num_experts_per_tok) and be aligned with the row's input_ids"
        )
    routes_NLK = routed_experts.to(device=device, dtype=torch.int64, non_blocking=True)
    moe_NLK = routes_NLK[:, list(settings.moe_layers)]
    unrouted_NL = moe_NLK == -1
    bad_range = ((moe_NLK < -1) | (moe_NLK >= settings.num_experts)).any()
    partial = (unrouted_NL.any(-1) & ~unrouted_NL.all(-1)).any()
    if bool(bad_range | partial):
        worst = int(moe_NLK.max())
        raise ValueError(
            f"packed_row.routed_experts holds expert ids outside [0, {settings.num_experts}) (largest {worst}) "
            "or a token with -1 in some but not all of its top-k slots: routes must name this model's experts "
            "(num_experts), with -1 in every slot of a token that has no route"
        )
    return RowRoutes(routes_NLK=routes_NLK)
