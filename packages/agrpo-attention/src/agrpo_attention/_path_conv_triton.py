"""The tree path's short causal convolution as Triton kernels that read every token where it lies.

Owns `triton_path_conv` (the contract of `_tree_deltanet.path_conv`, the PyTorch definition it is tested
against: depthwise causal conv of K taps along each token's own root-to-token path, then SiLU) and its torch
custom ops `agrpo::path_conv_forward` / `path_conv_backward` (autograd and fake implementations registered)
around three kernels (`_path_conv_triton_kernels.py`), over the (N, C) token-major projection output and
`ConvTables`:
1. `path_conv_forward_kernel`, one program per (32 tokens, 64 channels): out_t = act(b + sum_j w_{K-1-j}
   x_{p_j(t)}), p_j the token j steps back on t's path (`predecessors`), fp32 accumulation, stored in x's
   dtype;
2. `path_conv_backward_kernel`, one program per (128 tokens, 64 channels): recomputes the pre-activation
   of each token and of the K-1 tokens after it, dP_t = dOut_t act'(pre_t), and dx_s = sum_j w_{K-1-j}
   dP_{s+j} over the successors s + j whose predecessor j is s (on a chain: all of them), plus per-program
   partial sums of dw and db (summed by torch afterwards: deterministic, no atomics);
3. `path_conv_forks_kernel`, one program per (fork token, 64 channels): a fork's last K-1 tokens also
   precede the first tokens of its other children; their dx is recomputed over the full successor list
   (`fork_successors`) and overwrites what kernel 2 wrote.
Nothing is gathered, transposed or cast around the kernels, against the definition's halo copy, its
(C, E) transpose for conv1d, the fp32 round trip of the halo under autocast and the transposed output
(about 7.8 ms forward + backward per layer per 16k-token row of the 2B hybrid on the H200, 30% of the
layer, 2026-12-03). Does not know the delta rule; imports triton only when a kernel runs.

Legend: N = tokens, C = channels, K = taps, X = fork tokens, F = their successors, P = backward programs
along N.
"""

from __future__ import annotations

import torch

from ._deltanet_plan import ConvTables

TOKEN_BLOCK = 32
"""Tokens per forward program."""
CHANNEL_BLOCK = 64
"""Channels per program. Built for sm_90 with Triton 3.6 (4 warps, one stage, K = 4, bf16 activations): the
forward takes 138 registers, the backward 128, the fork kernel 96, none spills; 128 channels (or 32
backward tokens per tile) reach 255 registers and spill in the backward (`delta_rule_compile.py`)."""
BACKWARD_TOKEN_BLOCK = 16
"""Tokens per tile of the backward."""
BACKWARD_BLOCKS = 8
"""Tiles per backward program: P = N / 128 partial sums of dw."""
SUCCESSOR_BLOCK = 16
"""Successors per step of the fork kernel."""
NUM_WARPS = 4
NUM_STAGES = 1  # nothing to pipeline: no dots, short loops
_T = torch.Tensor


@torch.library.custom_op("agrpo::path_conv_forward", mutates_args=())
def path_conv_forward(
    x: _T, weight: _T, bias: _T | None, predecessors: _T, fork_tokens: _T, fork_offsets: _T,
    fork_successors: _T, silu: bool,
) -> _T:  # fmt: skip
    """x (N, C) contiguous, weight (C, 1, K), bias (C,) or None, the `ConvTables` (the fork tables are read
    by the backward only) -> act(conv) (N, C) in x's dtype."""
    from ._path_conv_triton_kernels import path_conv_forward_kernel

    out = torch.empty_like(x)
    num_tokens, channels = x.shape
    if num_tokens:
        grid = (-(-num_tokens // TOKEN_BLOCK), -(-channels // CHANNEL_BLOCK))
        path_conv_forward_kernel[grid](
            x, predecessors, weight, weight if bias is None else bias, out, num_tokens, channels,
            K=weight.shape[-1], BT=TOKEN_BLOCK, BC=CHANNEL_BLOCK, HAS_BIAS=bias is not None, SILU=silu,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return out


@path_conv_forward.register_fake
def _path_conv_forward_fake(x, weight, bias, predecessors, fork_tokens, fork_offsets, fork_successors, silu):
    return torch.empty_like(x)


@torch.library.custom_op("agrpo::path_conv_backward", mutates_args=())
def path_conv_backward(
    d_out: _T, x: _T, weight: _T, bias: _T | None, predecessors: _T, fork_tokens: _T, fork_offsets: _T,
    fork_successors: _T, silu: bool,
) -> tuple[_T, _T, _T]:  # fmt: skip
    """(dx (N, C) in x's dtype, dweight (C, 1, K) and dbias (C,) in the weight's dtype; dbias is empty without
    a bias) of `path_conv_forward`."""
    from ._path_conv_triton_kernels import path_conv_backward_kernel, path_conv_forks_kernel

    num_tokens, channels = x.shape
    taps = weight.shape[-1]
    programs = -(-num_tokens // (BACKWARD_TOKEN_BLOCK * BACKWARD_BLOCKS))
    dx = torch.empty_like(x)
    dw_parts = x.new_zeros(programs, taps, channels, dtype=torch.float32)
    db_parts = x.new_zeros(programs, channels, dtype=torch.float32)
    if num_tokens:
        bias_or_weight = weight if bias is None else bias
        sizes = dict(K=taps, HAS_BIAS=bias is not None, SILU=silu, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        path_conv_backward_kernel[(programs, -(-channels // CHANNEL_BLOCK))](
            x, predecessors, weight, bias_or_weight, d_out, dx, dw_parts, db_parts, num_tokens, channels,
            KP=1 << max(taps - 1, 0).bit_length(), BT=BACKWARD_TOKEN_BLOCK, BC=CHANNEL_BLOCK,
            BLOCKS=BACKWARD_BLOCKS, **sizes,
        )  # fmt: skip
        if fork_tokens.shape[0]:
            path_conv_forks_kernel[(fork_tokens.shape[0], -(-channels // CHANNEL_BLOCK))](
                x, predecessors, weight, bias_or_weight, d_out, fork_tokens, fork_offsets, fork_successors, dx,
                num_tokens, channels, BE=SUCCESSOR_BLOCK, BC=CHANNEL_BLOCK, **sizes,
            )  # fmt: skip
    d_weight = dw_parts.sum(0).t().unsqueeze(1).to(weight.dtype).contiguous()
    d_bias = db_parts.sum(0).to(weight.dtype) if bias is not None else weight.new_empty(0)
    return dx, d_weight, d_bias


@path_conv_backward.register_fake
def _path_conv_backward_fake(d_out, x, weight, bias, predecessors, fork_tokens, fork_offsets, fork_successors,
                             silu):  # fmt: skip
    return (
        torch.empty_like(x),
        torch.empty_like(weight),
        weight.new_empty(0 if bias is None else bias.shape[0]),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, *tables, silu = inputs
    ctx.save_for_backward(x, weight, bias, *tables)
    ctx.silu = silu


def _backward(ctx, d_out):
    x, weight, bias, *tables = ctx.saved_tensors
    dx, d_weight, d_bias = path_conv_backward(d_out.contiguous(), x, weight, bias, *tables, ctx.silu)
    return dx, d_weight, None if bias is None else d_bias, None, None, None, None, None


path_conv_forward.register_autograd(_backward, setup_context=_setup_context)


def triton_path_conv(
    mixed: torch.Tensor, conv: torch.nn.Conv1d, tables: ConvTables, activation: str
) -> torch.Tensor:
    """mixed (N, C) -> depthwise causal conv along each token's path, then SiLU (`activation` "silu" or
    "swish"), (N, C) in mixed's dtype, contiguous (its q/k/v splits are views with a row stride of C)."""
    if activation not in ("silu", "swish"):
        raise ValueError(f"the Triton path convolution runs SiLU only, got activation {activation!r}")
    weight = conv.weight if conv.weight.is_contiguous() else conv.weight.contiguous()
    return path_conv_forward(
        mixed.contiguous(), weight, conv.bias, tables.predecessors, tables.fork_tokens, tables.fork_offsets,
        tables.fork_successors, True,
    )  # fmt: skip
