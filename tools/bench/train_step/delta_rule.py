"""The Gated DeltaNet recurrence alone, over a step's rows: how much of a hybrid step the delta rule takes.

Owns `delta_rule_seconds`: for every row of the step, one linear-attention layer's `tree_delta_rule`
(the row's tree plan levels, the model's kernel: PyTorch's chunked rule where fla is absent) on random
inputs of the model's head shape (bf16 q/k/v as under autocast, fp32 gate), its forward and its
forward+backward timed with CUDA events after a warm-up, times the model's Gated DeltaNet layers; with
gradient checkpointing the forward runs once more (the recompute). The projections, the path
convolution and the gated norm around it are not included (they are ordinary matmuls and element-wise
work). Does not know the rest of the step.
"""

from __future__ import annotations

import time

import torch

from agrpo_attention import build_tree_plan
from agrpo_attention._model_patch import tree_settings
from agrpo_attention._tree_deltanet import tree_delta_rule
from agrpo_packing import PackedRow


def _inputs(config, num_tokens: int, device) -> list[torch.Tensor]:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    generator = torch.Generator(device).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    g = -torch.nn.functional.softplus(rand(1, num_tokens, hv, dtype=torch.float32)) * 0.1
    beta = rand(1, num_tokens, hv).sigmoid()
    tensors = [rand(1, num_tokens, hk, dk), rand(1, num_tokens, hk, dk), rand(1, num_tokens, hv, dv), g, beta]
    return [t.requires_grad_() for t in tensors]


def _seconds(run, device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def delta_rule_seconds(model, rows: list[PackedRow], *, checkpointing: bool) -> dict:
    """Seconds of the step's delta-rule recurrences (all rows, all Gated DeltaNet layers), by pass."""
    config = model.config
    layers = sum(t == "linear_attention" for t in getattr(config, "layer_types", []))
    kernel = tree_settings(model).deltanet_kernel
    device = next(model.parameters()).device
    forward = forward_backward = 0.0
    for row in rows:
        plan = build_tree_plan(row, model).deltanet
        q, k, v, g, beta = _inputs(config, row.num_tokens, device)

        def fwd(plan=plan, q=q, k=k, v=v, g=g, beta=beta):
            return tree_delta_rule(q, k, v, g, beta, plan, kernel)

        def fwd_bwd(fwd=fwd):
            out = fwd()
            out.backward(torch.ones_like(out))

        fwd_bwd()  # warm-up
        forward += _seconds(fwd, device)
        forward_backward += _seconds(fwd_bwd, device)
    step = layers * (forward_backward + (forward if checkpointing else 0.0))
    return {"delta_rule_layers": layers, "delta_rule_kernel": kernel, "delta_rule_fwd_s": layers * forward,
            "delta_rule_fwd_bwd_s": layers * forward_backward, "delta_rule_step_s": step}  # fmt: skip
