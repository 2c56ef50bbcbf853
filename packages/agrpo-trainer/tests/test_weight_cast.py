"""`WeightCast`: under bf16 autocast over fp32 weights each matmul weight is cast once per optimizer step,
whatever the number of micro-batches and recomputes, recast after the optimizer moves it, and training is
bit-identical to autocast's own cast in every forward."""

from __future__ import annotations

import copy

import torch

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups
from agrpo_trainer._layer_region import LayerRegions, RegionSettings
from agrpo_trainer._weight_cast import WeightCast, castable_names


def _rows(num: int):
    shape = GroupShape(num_prompts=2, rollouts_per_prompt=3, prompt_tokens=(8, 20), completion_tokens=(3, 12),
                       multi_turn_frac=0.0, vocab_size=512)  # fmt: skip
    rows = []
    for seed in range(num):
        row = TreeRow(0)
        row.extend(random_grpo_groups(shape, seed=seed))
        rows.append(row.pack())
    return rows


def _train(model, steps: int, rows, after_step=lambda: None) -> list[float]:
    """`steps` optimizer steps of all `rows` as micro-batches under bf16 autocast; the step losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for _ in range(steps):
        total = 0.0
        for row in rows:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = -(token_logprobs(model, row) * row.advantages).mean()
            loss.backward()
            total += float(loss.detach())
        after_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def test_one_cast_per_weight_per_step_and_training_bit_identical_to_autocasts_cast():
    """Full checkpointing: each micro-batch's recompute reuses the step's copies too."""
    stock = build_model(TinyModelSpec(num_layers=2, seed=3), build_tokenizer()).train()
    enable_tree_attention(stock, "reference")
    cast = copy.deepcopy(stock)
    regions = LayerRegions(RegionSettings(compile=False, checkpointing="full")).install(cast)
    num_weights = sum(len(castable_names(layer)) for layer in cast.model.layers)
    rows = _rows(3)
    casts = []
    losses = _train(cast, 2, rows, after_step=lambda: casts.append(regions.cast.casts))
    assert casts == [num_weights, 2 * num_weights]  # once per step over 3 micro-batches (and recomputes)
    assert losses == _train(stock, 2, rows)
    for (name, a), b in zip(cast.named_parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_forward_without_gradients_never_leaves_its_copy_for_training():
    layer = torch.nn.Linear(4, 3)
    cast = WeightCast()
    with torch.no_grad():
        first = cast.weights(layer, ["weight"], torch.bfloat16)["weight"]
    assert not first.requires_grad
    again = cast.weights(layer, ["weight"], torch.bfloat16)["weight"]
    assert again.requires_grad and again.grad_fn is not None and cast.casts == 2
    assert cast.weights(layer, ["weight"], torch.bfloat16)["weight"] is again  # now cached
    with torch.no_grad():
        layer.weight.add_(1.0)  # an in-place update (the optimizer's) moves the version counter
    assert cast.weights(layer, ["weight"], torch.bfloat16)["weight"] is not again


def test_castable_names_are_the_linear_weights_and_biases():
    layer = build_model(TinyModelSpec(num_layers=1), build_tokenizer()).model.layers[0]
    names = castable_names(layer)
    assert "self_attn.q_proj.weight" in names and "mlp.down_proj.weight" in names
    assert not any("norm" in name for name in names)  # RMSNorm weights stay as autocast leaves them
