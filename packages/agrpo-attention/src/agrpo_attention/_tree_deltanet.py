"""Tree Gated DeltaNet: a Qwen3.5- or Qwen3-Next-style linear-attention layer run over a packed prefix tree.

Owns the layer's tree forward (same weights, same math as transformers' `Qwen3_5GatedDeltaNet` and
`Qwen3NextGatedDeltaNet`): projections per token, the only step where the two layouts differ (Qwen3.5 has
separate q/k/v, z, b and a projections; Qwen3-Next fuses them into `in_proj_qkvz` and `in_proj_ba`, whose
outputs are grouped per key head: [q, k, v, z] of each key head's value heads side by side, then [b, a] the
same way, which `_next_projections` regroups exactly as the stock forward does); the short causal convolution along each token's own path (the halo layout of
`DeltaNetPlan` in PyTorch, the definition; agrpo's Triton kernels reading tokens in place on CUDA,
`_path_conv_triton.py`); the chunked gated delta rule, each segment starting from its parent's final state
(level by level, or the whole tree in one call of agrpo's Triton rule); gated RMSNorm and the output
projection per token. Also owns the table of delta-rule kernels ("torch": pure PyTorch, any device, the
definition; "fla": fla-core's Triton kernels, CUDA; "triton": agrpo's own Triton kernels, CUDA, for where
fla's backward is refused), how "auto" picks among them, which convolution goes with each, and the check
that a module has one of the projection layouts this forward reads (any other is refused, naming both). Does not know attention backends or how the
module got patched (see `_model_patch.py`).

Legend: N = packed tokens, C = conv channels (2 * key_dim + value_dim), Hk/Hv = heads, dk/dv = dims.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._delta_rule_fla import fla_unavailable_reason, fla_varlen_gated_delta_rule
from ._delta_rule_torch import varlen_gated_delta_rule
from ._delta_rule_triton import (
    runs_fused,
    triton_tree_delta_rule,
    triton_unavailable_reason,
    triton_varlen_gated_delta_rule,
)
from ._deltanet_plan import DeltaNetPlan
from ._exceptions import BackendUnavailableError, UnsupportedModelError
from ._path_conv_triton import triton_path_conv

DELTA_RULE_KERNELS = {
    "torch": varlen_gated_delta_rule,
    "fla": fla_varlen_gated_delta_rule,
    "triton": triton_varlen_gated_delta_rule,
}
_UNAVAILABLE_REASON = {"fla": fla_unavailable_reason, "triton": triton_unavailable_reason}
_AUTO_ORDER = ("fla", "triton")  # fla-core where it trains (it is the maintained kernel), then ours

_SHARED_ATTRIBUTES = (
    "conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
    "activation",
)  # fmt: skip
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def _qwen3_5_projections(module, hidden_states: torch.Tensor):
    """Separate projections: hidden (1, N, H) -> mixed q|k|v (N, C), z (1, N, Hv dv), b and a (1, N, Hv)."""
    mixed = module.in_proj_qkv(hidden_states)[0]
    return (
        mixed,
        module.in_proj_z(hidden_states),
        module.in_proj_b(hidden_states),
        module.in_proj_a(hidden_states),
    )


def _next_projections(module, hidden_states: torch.Tensor):
    """Qwen3-Next's fused projections, regrouped as its stock forward does: in_proj_qkvz's output is, per key
    head, [q (dk), k (dk), v (r dv), z (r dv)] with r = Hv / Hk value heads per key head, and in_proj_ba's is,
    per key head, [b (r), a (r)]. Same return as `_qwen3_5_projections`."""
    num_tokens, key_heads = hidden_states.shape[1], module.num_k_heads
    per_key = module.num_v_heads // key_heads * module.head_v_dim
    qkvz = module.in_proj_qkvz(hidden_states)[0].view(num_tokens, key_heads, -1)
    q, k, v, z = torch.split(qkvz, [module.head_k_dim, module.head_k_dim, per_key, per_key], dim=-1)
    ba = module.in_proj_ba(hidden_states).view(1, num_tokens, key_heads, -1)
    b, a = torch.split(ba, [ba.shape[-1] // 2] * 2, dim=-1)
    mixed = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
    return mixed, z.reshape(1, num_tokens, -1), b.reshape(1, num_tokens, -1), a.reshape(1, num_tokens, -1)


_LAYOUTS = {
    "Qwen3.5 (in_proj_qkv/in_proj_z/in_proj_b/in_proj_a)": (
        ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
        _qwen3_5_projections,
    ),
    "Qwen3-Next (fused in_proj_qkvz/in_proj_ba)": (
        ("in_proj_qkvz", "in_proj_ba", "num_k_heads", "num_v_heads"),
        _next_projections,
    ),
}
"""Gated DeltaNet projection layouts with a tree forward: the attributes each needs, and its projection step."""


def _layout(module) -> str | None:
    return next(
        (name for name, (needs, _) in _LAYOUTS.items() if all(hasattr(module, a) for a in needs)), None
    )


def check_deltanet_module(module: torch.nn.Module, name: str) -> None:
    """Raise UnsupportedModelError unless `module` has the Qwen3.5 or the Qwen3-Next Gated DeltaNet layout."""
    layout = _layout(module)
    missing = [a for a in _SHARED_ATTRIBUTES if not hasattr(module, a)]
    if layout is None or missing:
        wanted = "; ".join(f"{layout_name}: {list(needs)}" for layout_name, (needs, _) in _LAYOUTS.items())
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) has no Gated DeltaNet layout with a tree forward"
            f"{f' (lacks {missing})' if missing else ''}: the supported layouts are {wanted}, each with "
            f"{list(_SHARED_ATTRIBUTES)}; train this model without tree attention"
        )
    if module.activation not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{name}: conv activation {module.activation!r}, expected one of {list(_ACTIVATIONS)}"
        )


def resolve_delta_rule_kernel(name: str, device: torch.device) -> str:
    """ "auto" -> "fla" where fla-core's kernels train (CUDA, installed, not hit by fla issue #640), else
    "triton" (CUDA with triton), else "torch"; explicit names are checked against the device."""
    if name == "auto":
        return next((k for k in _AUTO_ORDER if _UNAVAILABLE_REASON[k](device) is None), "torch")
    if name not in DELTA_RULE_KERNELS:
        raise BackendUnavailableError(
            f"deltanet_kernel={name!r}; expected 'auto' or one of {sorted(DELTA_RULE_KERNELS)}"
        )
    if name in _UNAVAILABLE_REASON and (reason := _UNAVAILABLE_REASON[name](device)) is not None:
        raise BackendUnavailableError(f"deltanet_kernel={name!r} cannot run here: {reason}")
    return name


def path_conv(
    mixed: torch.Tensor, conv: torch.nn.Conv1d, plan: DeltaNetPlan, activation: str
) -> torch.Tensor:
    """mixed (N, C) -> depthwise causal conv along each token's path, then the activation, (N, C): the
    definition (halo copy, one conv1d; autocast runs it in bf16)."""
    padded = torch.cat([mixed, mixed.new_zeros(1, mixed.shape[1])])
    halo = padded.index_select(0, plan.halo_index)  # (E, C)
    weight = conv.weight  # (C, 1, K)
    out = F.conv1d(halo.t().unsqueeze(0).to(weight.dtype), weight, conv.bias, groups=weight.shape[0])
    out = out[0].index_select(1, plan.conv_out_index).t()
    return _ACTIVATIONS[activation](out).to(mixed.dtype)


@functools.cache
def _triton_runs_on(device: torch.device) -> bool:
    return triton_unavailable_reason(device) is None


@torch.compiler.assume_constant_result
def _triton_runs(device: torch.device) -> bool:
    """Whether agrpo's Triton kernels run on `device`: asked once per device, and a constant to dynamo (the
    check imports nothing it could trace), so a compiled layer does not break its graph here."""
    return _triton_runs_on(device)


def _conv_runs_triton(mixed: torch.Tensor, kernel: str) -> bool:
    """The Triton path convolution goes with the GPU delta-rule kernels ("triton", "fla") where agrpo's Triton rule
    could run (NVIDIA, compute capability >= 8), for fp32/bf16 activations; else the definition runs."""
    return kernel != "torch" and mixed.is_cuda and mixed.dtype != torch.float64 and _triton_runs(mixed.device)


def layer_path_conv(mixed: torch.Tensor, module, plan: DeltaNetPlan, kernel: str) -> torch.Tensor:
    """The layer's path convolution: agrpo's Triton kernels where `_conv_runs_triton` says, else the definition."""
    if _conv_runs_triton(mixed, kernel):
        return triton_path_conv(mixed, module.conv1d, plan.conv, module.activation)
    return path_conv(mixed, module.conv1d, plan, module.activation)


TRACED_KERNELS = ("triton",)
"""Delta-rule kernels whose tree forward is custom ops only (`agrpo::delta_rule_forward` over the whole tree in one
call, `agrpo::path_conv_forward`; fake and autograd registered): a torch.compile'd layer traces it in one graph for
rows of any shape. "torch" and "fla" loop over the row's tree levels on the host, which would unroll into the graph
and compile again for every other tree."""


def tree_delta_rule(q, k, v, g, beta, plan: DeltaNetPlan, kernel: str) -> torch.Tensor:
    """q/k (1, N, Hk, dk), v (1, N, Hv, dv), g/beta (1, N, Hv) -> output (1, N, Hv, dv). "triton" runs the
    whole tree in one call (`triton_tree_delta_rule`); the others, and triton's fallbacks, level by level."""
    if kernel == "triton" and runs_fused(q, k, v, g, beta):
        return triton_tree_delta_rule(q, k, v, g, beta, plan.segments)[0]
    run = DELTA_RULE_KERNELS[kernel]
    outputs, final = [], None
    for level in plan.levels:
        initial = None if level.parent_slot is None else final.index_select(0, level.parent_slot)
        picked = (x.index_select(1, level.token_index) for x in (q, k, v, g, beta))
        out, final = run(
            *picked,
            cu_seqlens=level.cu_seqlens,
            cu_seqlens_host=level.cu_seqlens_host,
            initial_state=initial,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1).index_select(1, plan.inverse_order)


def tree_deltanet_forward(
    module, hidden_states: torch.Tensor, plan: DeltaNetPlan, kernel: str
) -> torch.Tensor:
    """The tree forward of one Gated DeltaNet `module` (either layout): hidden (1, N, H) -> (1, N, H)."""
    num_tokens = hidden_states.shape[1]
    project = (
        _next_projections if hasattr(module, "in_proj_qkvz") else _qwen3_5_projections
    )  # checked at patch
    mixed, gate, b, a = project(module, hidden_states)
    mixed = layer_path_conv(mixed, module, plan, kernel)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, num_tokens, -1, module.head_k_dim)
    key = key.reshape(1, num_tokens, -1, module.head_k_dim)
    value = value.reshape(1, num_tokens, -1, module.head_v_dim)
    beta = b.sigmoid()
    gate_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    g = -module.A_log.to(gate_dtype).exp() * F.softplus(a.to(gate_dtype) + module.dt_bias)
    core = tree_delta_rule(query, key, value, g, beta, plan, kernel)
    gate = gate.reshape(-1, module.head_v_dim)
    core = module.norm(core.reshape(-1, module.head_v_dim), gate).reshape(1, num_tokens, -1)
    return module.out_proj(core)
