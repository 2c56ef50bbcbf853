"""The cascade backend: tree attention as dense flash-attention blocks merged by log-sum-exp, no K/V gather.

Owns the split of the tree's visibility into blocks a stock varlen flash kernel runs at full speed:
- "own": every segment attends causally to itself (cu_seqlens = q_offsets for queries and keys: exactly
  plain padding-free packing, no copy);
- "cross": every segment `a` with descendants is attended, in full (not causal), by all of its
  descendants' queries, the contiguous positions [end of a, subtree end of a). For GRPO rows this is one
  dense (all completions of a group) x (its prompt) block per prompt, instead of one short-query call per
  completion over a gathered copy of the prompt.
The partial outputs are merged with their log-sum-exps (fp32). Backward runs the flash backward of every
block with the *merged* output and log-sum-exp (as ring attention does): that yields the exact
gradients of the whole softmax, so nothing is recomputed twice. Queries of the cross blocks are gathered
(each query once per ancestor that has descendants: once for GRPO rows); keys of the cross blocks are
the ancestor segments themselves, each listed once.
Kernels: `torch.ops.aten._flash_attention_forward/backward` (FA2 shipped with CUDA torch) for fp16/bf16
on CUDA, and a plain PyTorch twin (any device/dtype) that tests use to check the decomposition.
No softcap (a merged softcapped softmax needs the kernel's support), no sliding window (a cross block attends
whole ancestor segments from queries of several depths, which no single kernel window describes) and no sinks
(untested on a GPU here): `enable_tree_attention` refuses models that use them. Does not know transformers.

Legend: N = packed tokens, C = cross-block queries, K = cross-block keys, H = heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._tree_layout import TreeLayout
from .path_gather import refuse_unsupported


@dataclass(kw_only=True, slots=True, frozen=True)
class CascadeState:
    """Index tensors of the cross blocks of one row (None fields when nothing is shared)."""

    cross_q_index: torch.Tensor | None
    """(C,) int64: packed position of each cross-block query."""
    cross_k_index: torch.Tensor | None
    """(K,) int64: packed position of each cross-block key (ancestor segments, each once)."""
    cu_q: torch.Tensor | None
    """(B + 1,) int32 offsets of the cross blocks' queries."""
    cu_k: torch.Tensor | None
    """(B + 1,) int32 offsets of the cross blocks' keys."""
    max_q: int
    """Most queries of one cross block."""
    max_k: int
    """Most keys of one cross block."""


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    lengths = ends - starts
    return np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(
        lengths.sum()
    )


def build_cascade_state(layout: TreeLayout) -> CascadeState:
    """Cross blocks of `layout`: one per segment that has descendants."""
    q_off = np.asarray(layout.q_offsets_host, dtype=np.int64)
    starts, ends = q_off[:-1], q_off[1:]
    subtree = layout.subtree_end.cpu().numpy()[starts] if layout.num_segments else starts
    inner = np.nonzero(subtree > ends)[0]
    if inner.size == 0:
        return CascadeState(cross_q_index=None, cross_k_index=None, cu_q=None, cu_k=None, max_q=0, max_k=0)
    q_lo, q_hi, k_lo, k_hi = ends[inner], subtree[inner], starts[inner], ends[inner]
    device = layout.q_offsets.device

    def offsets(lengths):
        return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(
            device=device, dtype=torch.int32
        )

    return CascadeState(
        cross_q_index=torch.from_numpy(_ranges(q_lo, q_hi)).to(device),
        cross_k_index=torch.from_numpy(_ranges(k_lo, k_hi)).to(device),
        cu_q=offsets(q_hi - q_lo),
        cu_k=offsets(k_hi - k_lo),
        max_q=int((q_hi - q_lo).max()),
        max_k=int((k_hi - k_lo).max()),
    )


def _math_forward(q, k, v, cu_q, cu_k, causal, scale):
    """Plain PyTorch varlen attention with log-sum-exp: q (T, H, D), k/v (S, Hkv, D) -> out, lse (H, T)."""
    groups = q.shape[1] // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        q_b = q[int(cu_q[b]) : int(cu_q[b + 1])].transpose(0, 1).to(compute)
        k_b = k[int(cu_k[b]) : int(cu_k[b + 1])].transpose(0, 1).repeat_interleave(groups, 0).to(compute)
        v_b = v[int(cu_k[b]) : int(cu_k[b + 1])].transpose(0, 1).repeat_interleave(groups, 0).to(compute)
        scores = q_b @ k_b.transpose(1, 2) * scale
        if causal:
            lq, lk = scores.shape[-2:]
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            scores = scores.masked_fill(torch.arange(lk, device=q.device)[None, :] > rows, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append((torch.exp(scores - lse[..., None]) @ v_b).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def _math_backward(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    """Flash-style backward of `_math_forward` given the (merged) output and log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = (torch.zeros_like(x, dtype=compute) for x in (q, k, v))
    for b in range(cu_q.shape[0] - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        q_b, do_b, o_b = (x[qs].transpose(0, 1).to(compute) for x in (q, grad, out))
        k_b, v_b = (x[ks].transpose(0, 1).repeat_interleave(groups, 0).to(compute) for x in (k, v))
        scores = q_b @ k_b.transpose(1, 2) * scale
        if causal:
            lq, lk = scores.shape[-2:]
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            scores = scores.masked_fill(torch.arange(lk, device=q.device)[None, :] > rows, float("-inf"))
        probs = torch.exp(scores - lse[:, qs, None].to(compute))
        d_scores = probs * (do_b @ v_b.transpose(1, 2) - (do_b * o_b).sum(-1, keepdim=True))
        dq[qs] = (d_scores @ k_b * scale).transpose(0, 1)
        heads_k = k.shape[1]
        dk[ks] += (
            (d_scores.transpose(1, 2) @ q_b * scale)
            .view(heads_k, groups, -1, q.shape[2])
            .sum(1)
            .transpose(0, 1)
        )
        dv[ks] += (probs.transpose(1, 2) @ do_b).view(heads_k, groups, -1, q.shape[2]).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flash(q) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    if not _flash(q):
        return (*_math_forward(q, k, v, cu_q, cu_k, causal, scale), None)
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"flash varlen log-sum-exp has shape {tuple(lse.shape)}, expected (heads, tokens) "
            f"{(q.shape[1], q.shape[0])}: this torch build's FA2 is too old for backend='cascade'; use 'varlen'"
        )
    return out, lse, (rng, unused)


def _backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng_unused):
    """dq, dk, dv of one block; `rng_unused`: what the flash forward returned for them (None off flash)."""
    if not _flash(q):
        return _math_backward(grad, q, k, v, out, lse, cu_q, cu_k, causal, scale)
    rng, unused = rng_unused
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
    )


def _merge(out_own, lse_own, out_cross, lse_cross, q_index):
    """Softmax-weighted sum of the partial outputs: (N, H, D) and (H, N) fp32 log-sum-exp of the union."""
    index = q_index[None].expand(lse_own.shape[0], -1)
    peak = lse_own.clone().scatter_reduce_(1, index, lse_cross, reduce="amax")
    total = torch.exp(lse_own - peak).scatter_add_(1, index, torch.exp(lse_cross - peak.gather(1, index)))
    lse = peak + torch.log(total)
    compute = torch.promote_types(out_own.dtype, torch.float32)
    out = out_own.to(compute) * torch.exp(lse_own - lse).t()[..., None]
    weights = torch.exp(lse_cross - lse.gather(1, index)).t()[..., None]
    out.index_add_(0, q_index, out_cross.to(compute) * weights)
    return out.to(out_own.dtype), lse


def _placeholder_rng(q):
    """What FA2's backward takes for the dropout RNG state; never read at dropout 0."""
    if not _flash(q):
        return None
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    return empty, empty


@torch.library.custom_op("agrpo::cascade_attention", mutates_args=())
def _cascade_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    max_own: int,
    cross_q_index: torch.Tensor | None,
    cross_k_index: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, H, D), k/v (N, Hkv, D) -> out (N, H, D) and its fp32 log-sum-exp (H, N)."""
    out, lse, _ = _forward(q, k, v, q_offsets, q_offsets, max_own, max_own, True, scale)
    if cross_q_index is not None:
        qi, ki = cross_q_index, cross_k_index
        out_c, lse_c, _ = _forward(q[qi], k[ki], v[ki], cu_q, cu_k, max_q, max_k, False, scale)
        out, lse = _merge(out, lse, out_c, lse_c, qi)
    return out.contiguous(), lse.contiguous()


@_cascade_forward.register_fake
def _(q, k, v, q_offsets, max_own, cross_q_index, cross_k_index, cu_q, cu_k, max_q, max_k, scale):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32))
    return torch.empty_like(q), lse


@torch.library.custom_op("agrpo::cascade_attention_backward", mutates_args=())
def _cascade_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    max_own: int,
    cross_q_index: torch.Tensor | None,
    cross_k_index: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block's flash backward with the merged output and log-sum-exp (exact gradients of the union)."""
    rng = _placeholder_rng(q)
    own = _backward(grad, q, k, v, out, lse, q_offsets, q_offsets, max_own, max_own, True, scale, rng)
    if cross_q_index is None:
        return tuple(torch.empty_like(x).copy_(g) for x, g in zip((q, k, v), own, strict=True))
    qi, ki = cross_q_index, cross_k_index
    cross = _backward(
        grad[qi], q[qi], k[ki], v[ki], out[qi], lse[:, qi].contiguous(),
        cu_q, cu_k, max_q, max_k, False, scale, rng,
    )  # fmt: skip
    compute = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = (g.to(compute) for g in own)
    dq.index_add_(0, qi, cross[0].to(compute))
    dk.index_add_(0, ki, cross[1].to(compute))
    dv.index_add_(0, ki, cross[2].to(compute))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_cascade_backward.register_fake
def _(grad, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, max_own, qi, ki, cu_q, cu_k, max_q, max_k, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], q_offsets, qi, ki, cu_q, cu_k)
    ctx.ints = (max_own, max_q, max_k, scale)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, q_offsets, qi, ki, cu_q, cu_k = ctx.saved_tensors
    max_own, max_q, max_k, scale = ctx.ints
    grads = _cascade_backward(
        grad_out.contiguous(), q, k, v, out, lse, q_offsets, max_own, qi, ki, cu_q, cu_k, max_q, max_k, scale
    )
    return *grads, *(None for _ in range(9))


_cascade_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def cascade_attention(query, key, value, layout: TreeLayout, state: CascadeState, *, scaling: float):
    """query (1, Hq, N, D), key/value (1, Hkv, N, D) -> (1, N, Hq, D), any device (flash on CUDA fp16/bf16).
    One custom op forward and one backward: torch.compile sees opaque calls with known shapes, so a compiled
    decoder layer runs cascade rows without a graph break (the state is built in `prepare`, outside)."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out, _ = _cascade_forward(
        q, k, v, layout.q_offsets, layout.max_q, state.cross_q_index, state.cross_k_index,
        state.cu_q, state.cu_k, state.max_q, state.max_k, float(scaling),
    )  # fmt: skip
    return out.unsqueeze(0)


class CascadeBackend:
    """Own-segment causal blocks + ancestor cross blocks through FA2, merged by log-sum-exp (CUDA only)."""

    name = "cascade"
    supports_softcap = False
    supports_window = False
    supports_sinks = False
    input_dtypes = None  # FA2 for fp16/bf16, the plain PyTorch twin for float32
    forward_only_on = ()
    under_compile = "trace"  # its custom ops are opaque to dynamo: no graph break

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda" or torch.version.cuda is None:
            return f"cascade runs torch's flash-attention kernels (NVIDIA CUDA), the model is on {device}"
        return None

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> object:
        return build_cascade_state(layout)

    def attend(
        self, query, key, value, layout: TreeLayout, state, *, scaling, softcap, window=None, sinks=None
    ):
        refuse_unsupported(self, window, sinks)
        return cascade_attention(query, key, value, layout, state, scaling=scaling)
