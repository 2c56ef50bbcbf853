"""The gated delta rule through agrpo's own Triton kernels: chunked, over a segment tree, read in place.

Owns `triton_tree_delta_rule` (every segment of a packed row in one call, each starting from its parent's
final state: per tree level one launch of the sequential state scan, every other kernel once over all
chunks; no gather, concatenation or copy of q/k/v around the kernels), `triton_varlen_gated_delta_rule` (the
contract of `_delta_rule_torch.varlen_gated_delta_rule`, which stays the definition both are tested
against: sequences as roots with their own initial states), the torch custom ops `agrpo::delta_rule_forward`
/ `delta_rule_backward` around the kernels (autograd formula and fake implementations registered, so
torch.compile traces through them without a graph break), and `triton_unavailable_reason`. Precision: q/k
are L2-normalised in fp32 inside the first kernel as in the definition, the kernels keep the state and
every accumulator in fp32; dots run in tf32 for half-precision inputs (bf16 carries 8 bits of mantissa,
tf32 keeps 10) and in "tf32x3" (three tf32 products, ~fp32 accuracy) for fp32 ones: exact "ieee" FMA dots of
these tiles take minutes to compile and spill heavily. Outputs and gradients are stored in their tensors'
dtypes by the kernels themselves. Memory saved for the backward per token and head: (3 K + 2 V + C + K V /
C + 2) fp32 (q, k, w; v, u; T; the chunk states; beta and the inverse norm), 3.8 KB at K = V = 128, about
1 GB per layer for a 16k-token row of 16 heads. With fla-core installed, calls that need no gradient use
fla's forward level by level (it runs where its backward is refused). Imports triton only when a kernel
runs.

Legend: N = tokens, S = segments (B: sequences), Hk/Hv = key/value heads, K/V = head dims, C = chunk,
NT = chunks.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from ._delta_rule_fla import fla_varlen_gated_delta_rule
from ._delta_rule_torch import varlen_gated_delta_rule
from ._deltanet_plan import SegmentTables, chunk_table

CHUNK = 64
_FLA_INSTALLED = importlib.util.find_spec("fla") is not None
_T = torch.Tensor


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None if agrpo's Triton delta rule can train on `device`, else why not."""
    if device.type != "cuda":
        return f"the Triton delta rule needs a CUDA GPU, the model is on {device}"
    if torch.version.hip is not None:
        return (
            "the Triton delta rule is written for NVIDIA GPUs (tf32 dots); ROCm uses deltanet_kernel='torch'"
        )
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed: pip install triton"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "the Triton delta rule needs compute capability >= 8.0 (tf32 tensor cores)"
    return None


def _precision(tf32: bool) -> str:
    return "tf32" if tf32 else "tf32x3"


@torch.library.custom_op("agrpo::delta_rule_forward", mutates_args=())
def delta_rule_forward(
    q: _T, k: _T, v: _T, g: _T, beta: _T, initial_state: _T | None, offsets: _T, parent: _T, child_offsets: _T,
    children: _T, level_segments: _T, level_offsets: _T, chunk_offsets: _T, chunk_table: _T, tf32: bool,
) -> tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]:  # fmt: skip
    """q/k (N, Hk, K), v (N, Hv, V), g/beta (N, Hv) as the layer made them (any float dtype, strided), the
    roots' initial states (S, Hv, K, V) or None, the segment tables (`SegmentTables`, int32; level offsets
    int64 on the host; children are read by the backward only) -> (o (N, Hv, V) in v's dtype, final states
    (S, Hv, K, V) fp32, then what the backward reads: q_n, k_n, v, beta fp32, inverse norms, chunk states,
    U, W, T, G)."""
    from ._delta_rule_triton_forward import normalise_inputs, run_forward

    q_n, k_n, v32, g32, beta32, r_q, r_k = normalise_inputs(q, k, v, g, beta)
    tree = (offsets, parent, level_segments, level_offsets, chunk_offsets, chunk_table)
    o, final, *saved = run_forward(q_n, k_n, v32, g32, beta32, initial_state, tree, v.dtype, _precision(tf32))
    return o, final, q_n, k_n, v32, beta32, r_q, r_k, *saved


@delta_rule_forward.register_fake
def _delta_rule_forward_fake(q, k, v, g, beta, initial_state, offsets, parent, child_offsets, children,
                             level_segments, level_offsets, chunk_offsets, chunk_table, tf32):  # fmt: skip
    (num_tokens, key_heads, k_dim), (heads, v_dim) = q.shape, v.shape[1:]
    num_seqs, num_chunks = offsets.shape[0] - 1, chunk_table.shape[0]
    f32 = lambda *shape: q.new_empty(*shape, dtype=torch.float32)  # noqa: E731
    return (
        v.new_empty(num_tokens, heads, v_dim), f32(num_seqs, heads, k_dim, v_dim),
        f32(num_tokens, heads, k_dim), f32(num_tokens, heads, k_dim), f32(num_tokens, heads, v_dim),
        f32(num_tokens, heads), f32(num_tokens, key_heads), f32(num_tokens, key_heads),
        f32(num_chunks, heads, k_dim, v_dim), f32(num_tokens, heads, v_dim), f32(num_tokens, heads, k_dim),
        f32(num_chunks, heads, CHUNK, CHUNK), f32(num_chunks, heads, CHUNK),
    )  # fmt: skip


@torch.library.custom_op("agrpo::delta_rule_backward", mutates_args=())
def delta_rule_backward(
    q_n: _T, k_n: _T, v: _T, beta: _T, r_q: _T, r_k: _T, h: _T, u: _T, w: _T, tinv: _T, gcum: _T, offsets: _T,
    child_offsets: _T, children: _T, level_segments: _T, level_offsets: _T, chunk_offsets: _T, chunk_table: _T,
    d_out: _T, d_final: _T | None, dq_dtype: torch.dtype, dk_dtype: torch.dtype, dv_dtype: torch.dtype,
    dg_dtype: torch.dtype, dbeta_dtype: torch.dtype, tf32: bool,
) -> tuple[_T, _T, _T, _T, _T, _T]:  # fmt: skip
    """Gradients (dq, dk, dv, dg, dbeta in the dtypes of q, k, v, g, beta; d start state of every segment) of
    `delta_rule_forward`'s o and final states."""
    from ._delta_rule_triton_backward import run_backward

    saved = (q_n, k_n, v, beta, r_q, r_k, h, u, w, tinv, gcum)
    tree = (offsets, child_offsets, children, level_segments, level_offsets, chunk_offsets, chunk_table)
    dtypes = (dq_dtype, dk_dtype, dv_dtype, dg_dtype, dbeta_dtype)
    return run_backward(saved, tree, d_out, d_final, dtypes, _precision(tf32))


@delta_rule_backward.register_fake
def _delta_rule_backward_fake(q_n, k_n, v, beta, r_q, r_k, h, u, w, tinv, gcum, offsets, child_offsets,
                              children, level_segments, level_offsets, chunk_offsets, chunk_table, d_out,
                              d_final, *dtypes_and_tf32):  # fmt: skip
    (num_tokens, heads, k_dim), key_heads, dtypes = q_n.shape, r_q.shape[1], dtypes_and_tf32[:5]
    v_dim = v.shape[2]
    return (q_n.new_empty(num_tokens, key_heads, k_dim, dtype=dtypes[0]),
            q_n.new_empty(num_tokens, key_heads, k_dim, dtype=dtypes[1]), torch.empty_like(v, dtype=dtypes[2]),
            torch.empty_like(beta, dtype=dtypes[3]), torch.empty_like(beta, dtype=dtypes[4]),
            q_n.new_empty(offsets.shape[0] - 1, heads, k_dim, v_dim))  # fmt: skip


_TABLES = slice(6, 14)  # the segment tables among delta_rule_forward's inputs


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, *_ = inputs
    tf32 = inputs[-1]
    saved = output[2:]
    ctx.save_for_backward(*saved, *inputs[_TABLES])
    ctx.dtypes = [q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype]
    ctx.tf32, ctx.has_initial = tf32, initial_state is not None
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero (NT, H, K, V) gradients for the saved-only outputs


def _backward(ctx, d_out, d_final, *_saved_only):
    q_n, k_n, v, beta, r_q, r_k, h, u, w, tinv, gcum, offsets, _parent, *tables = ctx.saved_tensors
    d_out = torch.zeros_like(v, dtype=ctx.dtypes[2]) if d_out is None else d_out.contiguous()
    d_final = None if d_final is None else d_final.float().contiguous()
    grads = delta_rule_backward(q_n, k_n, v, beta, r_q, r_k, h, u, w, tinv, gcum, offsets, *tables, d_out, d_final,
                                *ctx.dtypes, ctx.tf32)  # fmt: skip
    dq, dk, dv, dg, dbeta, d_start = grads
    return (dq, dk, dv, dg, dbeta, d_start if ctx.has_initial else None, *([None] * 9))


delta_rule_forward.register_autograd(_backward, setup_context=_setup_context)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def runs_fused(q: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """True where `triton_tree_delta_rule` runs agrpo's kernels: fp64 goes to the PyTorch definition, and with
    fla-core installed a CUDA call that needs no gradient to fla's forward (both through the level loop)."""
    if q.dtype == torch.float64:
        return False
    return not (_FLA_INSTALLED and q.is_cuda and not _needs_grad(q, *tensors))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_tree_delta_rule(q, k, v, g, beta, segments: SegmentTables, initial_state=None):
    """The delta rule over a segment tree in one call: q/k (1, N, Hk, K), v (1, N, Hv, V), g/beta (1, N, Hv)
    in packed order, each segment starting from its parent's final state (a root from `initial_state`
    (S, Hv, K, V), or zero) -> (output (1, N, Hv, V) in v's dtype, final states (S, Hv, K, V) fp32)."""
    tables = (segments.offsets, segments.parent, segments.child_offsets, segments.children,
              segments.level_segments, segments.level_offsets_host, segments.chunk_offsets, segments.chunk_table)  # fmt: skip
    q, k, v = (_last_dim_contiguous(x[0]) for x in (q, k, v))
    out, final, *_ = delta_rule_forward(
        q, k, v, g[0], beta[0], initial_state, *tables, v.dtype != torch.float32
    )
    return out.unsqueeze(0), final


def _roots(cu_seqlens: torch.Tensor, cu_seqlens_host: tuple[int, ...]) -> SegmentTables:
    """`SegmentTables` of sequences that are all roots (the varlen contract)."""
    num_seqs, device = len(cu_seqlens_host) - 1, cu_seqlens.device
    chunk_offsets, table = chunk_table(np.diff(np.asarray(cu_seqlens_host, dtype=np.int64)))
    int32 = lambda x: torch.as_tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    return SegmentTables(
        offsets=cu_seqlens.to(torch.int32), parent=int32(np.full(num_seqs, -1)),
        child_offsets=int32(np.zeros(num_seqs + 1)), children=int32(np.zeros(0)),
        level_segments=int32(np.arange(num_seqs)), level_offsets_host=torch.tensor([0, num_seqs]),
        chunk_offsets=int32(chunk_offsets), chunk_table=int32(table),
    )  # fmt: skip


def triton_varlen_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens, cu_seqlens_host, initial_state):
    """Same contract as `_delta_rule_torch.varlen_gated_delta_rule` (q/k (1, N, Hk, K), v (1, N, Hv, V),
    g/beta (1, N, Hv) -> output (1, N, Hv, V) in v's dtype, final states (B, Hv, K, V) fp32): every sequence a
    root of `triton_tree_delta_rule`. fp64 inputs go to the PyTorch definition; forward-only calls to
    fla-core's forward where it is installed."""
    kwargs = dict(cu_seqlens=cu_seqlens, cu_seqlens_host=cu_seqlens_host, initial_state=initial_state)
    if v.dtype == torch.float64:
        return varlen_gated_delta_rule(q, k, v, g, beta, **kwargs)
    if not runs_fused(q, k, v, g, beta, initial_state):
        return fla_varlen_gated_delta_rule(q, k, v, g, beta, **kwargs)
    initial = None if initial_state is None else initial_state.float().contiguous()
    return triton_tree_delta_rule(q, k, v, g, beta, _roots(cu_seqlens, cu_seqlens_host), initial)
