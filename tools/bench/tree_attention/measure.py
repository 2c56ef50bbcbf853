"""Timing and FLOP accounting of one fwd+bwd over packed rows, and of tree attention alone.

Owns: `time_rows` (token_logprobs + backward of the advantage-weighted sum, per row, plans prebuilt
and timed separately, CUDA-synchronised wall clock, median of repeats), `attention_only` (one
attention layer's fwd+bwd on random bf16 q/k/v over a row's layout: the kernel in isolation),
and the FLOP model used for TFLOP/s and MFU: 6 x tokens x (linear weights of the decoder layers),
6 x loss terms x hidden x vocab for the LM head, and 14 x score pairs x query heads x head dim per
full-attention layer (flash-attention accounting: 4 forward, 10 backward). Gated DeltaNet recurrence
FLOPs are not counted (their projections are). Peak for MFU: 989 TFLOP/s, the H200 SXM dense bf16
datasheet figure. Does not know how rows were built.
"""

from __future__ import annotations

import statistics
import time

import torch

from agrpo_attention import build_tree_plan, token_logprobs
from agrpo_packing import PackedRow

PEAK_TFLOPS = 989.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_matmul_params(model) -> int:
    """Weights of the decoder layers' matrix multiplies (norms, biases, embeddings excluded)."""
    return sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)


def full_attention_layers(model) -> int:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return sum(t == "full_attention" for t in types)


def attention_flops(score_pairs: int, heads: int, head_dim: int) -> float:
    return 14.0 * score_pairs * heads * head_dim


def step_flops(model, rows: list[PackedRow], plans) -> float:
    config = model.config
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    total = 0.0
    for row, plan in zip(rows, plans, strict=True):
        total += 6.0 * row.num_tokens * layer_matmul_params(model)
        total += 6.0 * row.num_loss_terms * config.hidden_size * config.vocab_size
        pairs = plan.layout.score_pairs
        total += full_attention_layers(model) * attention_flops(pairs, config.num_attention_heads, head_dim)
    return total


def _step(model, row: PackedRow, plan) -> None:
    logprobs = token_logprobs(model, row, plan=plan)
    (logprobs * row.advantages.to(logprobs.device)).sum().backward()


def time_rows(model, rows: list[PackedRow], *, repeats: int, warmup: int = 1) -> dict:
    """Seconds of one fwd+bwd over all `rows` (median of `repeats`), and of building their plans."""
    device = next(model.parameters()).device
    _sync(device)
    start = time.perf_counter()
    plans = [build_tree_plan(row, model) for row in rows]  # from host rows, as a data loader would
    _sync(device)
    plan_seconds = time.perf_counter() - start
    rows = [row.to(device) for row in rows]
    samples = []
    for attempt in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        for row, plan in zip(rows, plans, strict=True):
            _step(model, row, plan)
        _sync(device)
        if attempt >= warmup:
            samples.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return {
        "seconds": statistics.median(samples),
        "plan_seconds": plan_seconds,
        "flops": step_flops(model, rows, plans),
    }


def attention_only(row: PackedRow, backend: str, *, heads: int, kv_heads: int, head_dim: int, device: str,
                   repeats: int = 5) -> dict:  # fmt: skip
    """fwd+bwd of one tree-attention call over `row` with random bf16 inputs: seconds and TFLOP/s."""
    plan = build_tree_plan(row, backend=backend, device=device)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    n = row.num_tokens
    q = torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, n, head_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, n, heads, head_dim, device=device, dtype=dtype)
    samples = []
    for attempt in range(repeats + 2):
        _sync(torch.device(device))
        start = time.perf_counter()
        plan.attend(q, k, v).backward(grad)
        _sync(torch.device(device))
        if attempt >= 2:
            samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    flops = attention_flops(plan.layout.score_pairs, heads, head_dim)
    return {"seconds": seconds, "tflops": flops / seconds / 1e12, "pairs": plan.layout.score_pairs}
