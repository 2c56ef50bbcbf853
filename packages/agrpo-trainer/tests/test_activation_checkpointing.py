"""Activation checkpointing modes: `full`, `selective` and `none` give the same gradients; `selective`
recomputes the MLP's matmuls, the norms and elementwise ops and keeps the attention kernel's and the
attention projections' outputs."""

from __future__ import annotations

import copy

import torch

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups
from agrpo_trainer._activation_checkpointing import keeps_output, mlp_weight_shapes
from agrpo_trainer._layer_region import LayerRegions, RegionSettings


def _row():
    shape = GroupShape(num_prompts=2, rollouts_per_prompt=3, prompt_tokens=(8, 20), completion_tokens=(3, 12),
                       vocab_size=512)  # fmt: skip
    row = TreeRow(0)
    row.extend(random_grpo_groups(shape, seed=1))
    return row.pack()


def test_the_mlp_shapes_are_its_linear_layers():
    layer = build_model(TinyModelSpec(num_layers=1), build_tokenizer()).model.layers[0]
    assert mlp_weight_shapes(layer) == ((64, 128), (128, 64))  # gate/up (64 -> 128), down (128 -> 64)


def test_selective_keeps_attention_and_its_projections_and_recomputes_the_rest():
    mlp = ((64, 128), (128, 64))
    x = torch.empty(10, 64)
    assert keeps_output(torch.ops.agrpo.tree_attention.default, (), mlp)
    assert keeps_output(torch.ops.aten.mm.default, (x, torch.empty(64, 64)), mlp)  # q / o projection
    assert keeps_output(torch.ops.aten.mm.default, (x, torch.empty(64, 32)), mlp)  # k / v projection
    assert not keeps_output(torch.ops.aten.mm.default, (x, torch.empty(64, 128)), mlp)  # gate / up
    assert not keeps_output(torch.ops.aten.addmm.default, (torch.empty(128), x, torch.empty(64, 128)), mlp)
    assert not keeps_output(torch.ops.aten.mul.Tensor, (x, x), mlp)
    assert not keeps_output(torch.ops.aten.rsqrt.default, (x,), mlp)


def test_every_mode_gives_the_same_gradients():
    base = build_model(TinyModelSpec(num_layers=2, seed=2), build_tokenizer()).train()
    enable_tree_attention(base, "reference")
    row = _row()
    grads = {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        LayerRegions(RegionSettings(compile=False, checkpointing=mode)).install(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (token_logprobs(model, row) * row.advantages).sum().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in ("full", "selective"):
        for got, want in zip(grads[mode], grads["none"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
