"""The gated delta rule in plain PyTorch: chunked, batched, starting from given states, fp32.

Owns `chunk_gated_delta_rule` (equal-length batch) and `varlen_gated_delta_rule` (sequences packed
back to back with cu_seqlens, each from its own initial state, returning each final state): the CPU
path of tree Gated DeltaNet and the reference its Triton path is checked against. Math follows
transformers' Qwen3.5 `torch_chunk_gated_delta_rule` (q/k L2-normalised in fp32, q scaled by
dk^-0.5, grouped value heads by repeating q/k) so packed and per-sample forwards agree to fp32
rounding. Gradients come from autograd through every step, including into the initial state, so
they are exact (no hand-written backward). Does not know trees or models.

Legend: B = sequences, T = tokens, Hk/Hv = key/value heads, dk/dv = head dims, C = chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, T, ...) fp32 -> (B, H, T/C, C, ...) after zero-padding T to a multiple of C."""
    pad = (-x.shape[2]) % chunk
    if pad:
        widths = [0, 0] * (x.dim() - 3) + [0, pad]
        x = F.pad(x, widths)
    return x.reshape(x.shape[0], x.shape[1], -1, chunk, *x.shape[3:])


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK_SIZE):
    """q/k (B, T, Hk, dk), v (B, T, Hv, dv), g/beta (B, T, Hv), initial_state (B, Hv, dk, dv) ->
    (output (B, T, Hv, dv) in v's dtype, final state (B, Hv, dk, dv) fp32, fp64 for fp64 inputs). Zero-padded tail tokens
    (g = beta = 0) leave the state unchanged, so a padded sequence's final state is its own."""
    num_tokens, rep, out_dtype = q.shape[1], v.shape[2] // q.shape[2], v.dtype
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(compute) for x in (q, k, v, g, beta))
    q = _l2norm(q) * q.shape[-1] ** -0.5
    k = _l2norm(k)
    q, k, v, g, beta = (_to_chunks(x, chunk) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g_cum = g.cumsum(dim=-1)  # (B, H, n, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g_cum.exp()[..., None]
    k_decayed = k * (g_cum[..., -1:] - g_cum).exp()[..., None]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)
    batch, heads, dk, dv = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    state = q.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state.to(compute)
    outputs = []
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, dv)[:, :, :num_tokens]
    return out.transpose(1, 2).to(out_dtype), state


def varlen_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens, cu_seqlens_host, initial_state):
    """Inputs (1, T, ...) holding sequences back to back (cu_seqlens (B + 1,)); initial_state
    (B, Hv, dk, dv) or None -> (output (1, T, Hv, dv), final states (B, Hv, dk, dv) fp32)."""
    dtype = v.dtype
    total = q.shape[1]
    lengths = [b - a for a, b in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:], strict=True)]
    width = -(-max(lengths) // CHUNK_SIZE) * CHUNK_SIZE
    slot = torch.arange(width, device=q.device)
    starts = cu_seqlens[:-1, None].to(q.device)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1])[:, None].to(q.device)
    index = torch.where(slot[None, :] < lens, starts + slot[None, :], total)  # (B, width), T = zero row

    def batched(x: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
        return padded[index]

    out, final = chunk_gated_delta_rule(*(batched(x) for x in (q, k, v, g, beta)), initial_state)
    valid = (slot[None, :] < lens).reshape(-1)
    out = out.reshape(-1, *out.shape[2:])[valid]
    return out.unsqueeze(0).to(dtype), final
