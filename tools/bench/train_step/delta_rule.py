"""The Gated DeltaNet recurrence alone, over a step's rows: how much of a hybrid step the delta rule takes.

Owns `delta_rule_seconds`: for every row of the step, one linear-attention layer's `tree_delta_rule`
(the row's tree plan, the model's kernel: agrpo's Triton rule on CUDA where fla cannot train) on random
inputs of the model's head shape (bf16 q/k/v as under autocast, fp32 gate), its forward and its
forward+backward timed with CUDA events after a warm-up, times the model's Gated DeltaNet layers; with
gradient checkpointing the forward runs once more (the recompute). The same for the layer's path
convolution (the kernel the layer runs with that delta-rule kernel: Triton on CUDA, else PyTorch) on random
bf16 projections, as `conv_*` keys. The projections and the gated norm are not included (ordinary matmuls
and element-wise work). Does not know the rest of the step.
"""

from __future__ import annotations

import time

import torch

from agrpo_attention import build_tree_plan
from agrpo_attention._model_patch import tree_settings
from agrpo_attention._tree_deltanet import layer_path_conv, tree_delta_rule
from agrpo_packing import PackedRow


def layer_inputs(config, num_tokens: int, device) -> list[torch.Tensor]:
    """Random q, k, v (bf16), g (fp32) and beta (bf16) leaves of one Gated DeltaNet layer of `config`, as the
    layer hands them to the delta rule under autocast: (1, N, H, D) and (1, N, H)."""
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


def _forward_and_backward(fwd, device) -> tuple[float, float]:
    """(seconds of `fwd()`, of `fwd()` and the backward of its sum), after a warm-up."""

    def fwd_bwd():
        out = fwd()
        out.backward(torch.ones_like(out))

    fwd_bwd()
    return _seconds(fwd, device), _seconds(fwd_bwd, device)


def delta_rule_seconds(model, rows: list[PackedRow], *, checkpointing: bool) -> dict:
    """Seconds of the step's delta-rule recurrences and path convolutions (all rows, all Gated DeltaNet
    layers), by pass."""
    config = model.config
    layer_types = list(getattr(config, "layer_types", []))
    layers = layer_types.count("linear_attention")
    module = model.model.layers[layer_types.index("linear_attention")].linear_attn
    kernel = tree_settings(model).deltanet_kernel
    device = next(model.parameters()).device
    seconds = dict.fromkeys(("fwd", "fwd_bwd", "conv_fwd", "conv_fwd_bwd"), 0.0)
    for row in rows:
        plan = build_tree_plan(row, model).deltanet
        q, k, v, g, beta = layer_inputs(config, row.num_tokens, device)
        mixed = torch.randn(
            row.num_tokens, module.conv1d.weight.shape[0], device=device, dtype=torch.bfloat16
        )
        mixed.requires_grad_()

        def rule(plan=plan, q=q, k=k, v=v, g=g, beta=beta):
            return tree_delta_rule(q, k, v, g, beta, plan, kernel)

        def conv(plan=plan, mixed=mixed):
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                return layer_path_conv(mixed, module, plan, kernel)

        for key, run in (("", rule), ("conv_", conv)):
            forward, forward_backward = _forward_and_backward(run, device)
            seconds[f"{key}fwd"] += forward
            seconds[f"{key}fwd_bwd"] += forward_backward
    recompute = 1.0 if checkpointing else 0.0
    return {"delta_rule_layers": layers, "delta_rule_kernel": kernel, "delta_rule_fwd_s": layers * seconds["fwd"],
            "delta_rule_fwd_bwd_s": layers * seconds["fwd_bwd"],
            "delta_rule_step_s": layers * (seconds["fwd_bwd"] + recompute * seconds["fwd"]),
            "conv_step_s": layers * (seconds["conv_fwd_bwd"] + recompute * seconds["conv_fwd"])}  # fmt: skip
