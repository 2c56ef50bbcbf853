"""Tree Gated DeltaNet: a Qwen3.5-style linear-attention layer run over a packed prefix tree.

Owns the layer's tree forward (same weights, same math as transformers' `Qwen3_5GatedDeltaNet`):
projections per token; the short causal convolution along each token's own path (the halo layout of
`DeltaNetPlan` in PyTorch, the definition; agrpo's Triton kernels reading tokens in place on CUDA,
`_path_conv_triton.py`); the chunked gated delta rule, each segment starting from its parent's final state
(level by level, or the whole tree in one call of agrpo's Triton rule); gated RMSNorm and the output
projection per token. Also owns the table of delta-rule kernels ("torch": pure PyTorch, any device, the
definition; "fla": fla-core's Triton kernels, CUDA; "triton": agrpo's own Triton kernels, CUDA, for where
fla's backward is refused), how "auto" picks among them, which convolution goes with each, and the check
that a module has the projection layout this forward reads. Does not know attention backends or how the
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

_REQUIRED_ATTRIBUTES = (
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
    "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation",
)  # fmt: skip
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def check_deltanet_module(module: torch.nn.Module, name: str) -> None:
    """Raise UnsupportedModelError unless `module` has the Qwen3.5 Gated DeltaNet layout."""
    missing = [a for a in _REQUIRED_ATTRIBUTES if not hasattr(module, a)]
    if missing:
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}) lacks {missing}: only the Qwen3.5 Gated DeltaNet layout "
            "(separate in_proj_qkv/in_proj_z/in_proj_b/in_proj_a) has a tree forward; Qwen3-Next's fused "
            "in_proj_qkvz is not supported yet"
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
def _triton_runs(device: torch.device) -> bool:
    return triton_unavailable_reason(device) is None


def layer_path_conv(mixed: torch.Tensor, module, plan: DeltaNetPlan, kernel: str) -> torch.Tensor:
    """The layer's path convolution: agrpo's Triton kernels with the GPU delta-rule kernels ("triton", "fla")
    where agrpo's Triton rule could run (NVIDIA, compute capability >= 8), else the definition."""
    if kernel != "torch" and mixed.is_cuda and mixed.dtype != torch.float64 and _triton_runs(mixed.device):
        return triton_path_conv(mixed, module.conv1d, plan.conv, module.activation)
    return path_conv(mixed, module.conv1d, plan, module.activation)


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
    """The tree forward of one Qwen3.5 Gated DeltaNet `module`: hidden (1, N, H) -> (1, N, H)."""
    num_tokens = hidden_states.shape[1]
    mixed = layer_path_conv(module.in_proj_qkv(hidden_states)[0], module, plan, kernel)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, num_tokens, -1, module.head_k_dim)
    key = key.reshape(1, num_tokens, -1, module.head_k_dim)
    value = value.reshape(1, num_tokens, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()
    gate_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    g = -module.A_log.to(gate_dtype).exp() * F.softplus(
        module.in_proj_a(hidden_states).to(gate_dtype) + module.dt_bias
    )
    core = tree_delta_rule(query, key, value, g, beta, plan, kernel)
    gate = module.in_proj_z(hidden_states).reshape(-1, module.head_v_dim)
    core = module.norm(core.reshape(-1, module.head_v_dim), gate).reshape(1, num_tokens, -1)
    return module.out_proj(core)
