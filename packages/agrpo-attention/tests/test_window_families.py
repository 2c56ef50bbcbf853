"""The windowed families end to end: gpt-oss (alternating sliding/full layers, learned sinks, its MoE), Gemma 2
(alternating window, attention and final logit softcapping), Gemma 3 text (window + global layers, two RoPE
bases; also the text tower of `Gemma3ForConditionalGeneration` with its vision tower frozen) and Mistral (every
layer windowed). Packed tree rows (prompt + completions longer than the window, so windows cross the prompt and
segment boundaries) against each sample alone: in fp64 through the tree model itself (one-sample rows: exact,
so packing changes nothing), and in fp32 through the untouched transformers model with eager attention
(transformers' own windows, sinks and softcaps; its eager softmax runs in fp32 even for fp64 inputs, except
gpt-oss's, so fp32 is where the two are compared). Log-probs and every parameter's gradient, sinks included."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import TinyModelSpec, build_model
from agrpo_packing import PackSample, TreeRow
from agrpo_packing.testing import assert_packed_logprobs_match

KINDS = ["gpt_oss", "gemma2", "gemma3", "gemma3_vlm", "mistral"]
WINDOW = 8


@pytest.fixture(scope="module", params=KINDS)
def stock(request, tiny_tokenizer):
    """The kind's tiny model (window 8, 4 layers), eager attention: transformers' own windows, sinks and softcaps."""
    model = build_model(
        TinyModelSpec(kind=request.param, num_layers=4, sliding_window=WINDOW), tiny_tokenizer
    )
    model.set_attn_implementation("eager")
    if request.param == "gemma3_vlm":
        model.model.vision_tower.requires_grad_(False)
    return model


def _double(model):
    model = copy.deepcopy(model).double()
    if (
        hasattr(model, "set_experts_implementation")
        and model.config.get_text_config().model_type == "gpt_oss"
    ):
        model.set_experts_implementation("eager")  # torch's grouped_mm has no fp64
    return model


def alone_logprobs(model):
    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids[None], use_cache=False).logits[0, :-1]
        return logits.to(torch.float64).log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]

    return sequence_logprobs


def tree_alone_logprobs(model):
    """A sample forwarded alone through the tree-enabled model itself (a one-sample row)."""

    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        num = input_ids.shape[0] - 1
        row = TreeRow(0)
        row.add(PackSample(input_ids=input_ids.numpy(), trained_mask=np.arange(num + 1) > 0, group_id=0,
                           advantages=np.zeros(num), sampler_logprobs=np.zeros(num)))  # fmt: skip
        packed = row.pack()
        return token_logprobs(model, packed)[packed.position_ids[packed.token_index].argsort()]

    return sequence_logprobs


def packed_and_alone_gradients(tree_model, alone_model, row, atol, alone=alone_logprobs):
    tree_model.zero_grad()
    alone_model.zero_grad()
    packed, alone = assert_packed_logprobs_match(
        row, lambda r: token_logprobs(tree_model, r), alone(alone_model), atol=atol, rtol=0
    )
    weights = torch.randn(row.num_loss_terms, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (packed.double() * weights).sum().backward()
    (alone.double() * weights).sum().backward()
    pairs = zip(tree_model.named_parameters(), alone_model.named_parameters(), strict=True)
    return {
        name: (p.grad.double(), q.grad.double())
        for (name, p), (_, q) in pairs
        if p.requires_grad and q.grad is not None
    }


def assert_gradients_close(grads, rtol: float) -> None:
    floor = 1e-7 * max(float(alone.norm()) for _, alone in grads.values())
    for name, (packed, alone) in grads.items():
        error = float((packed - alone).norm())
        assert error <= rtol * float(alone.norm()) + floor, (
            f"{name}: {error:.3g} vs |alone| {alone.norm():.3g}"
        )


def test_packed_rows_are_exact_in_fp64_sinks_and_windows_included(stock, trees):
    row = trees.random_row(1, vocab=512, prompts=2, rollouts=3, longest=50)
    assert row.position_ids.max() > 3 * WINDOW
    tree = _double(stock)
    enable_tree_attention(tree, "reference")
    alone = copy.deepcopy(tree)
    grads = packed_and_alone_gradients(tree, alone, row, atol=1e-10, alone=tree_alone_logprobs)
    assert_gradients_close(grads, rtol=1e-6)  # fp32 casts inside transformers' norms and RoPE set this floor
    sinks = [name for name in grads if name.endswith("self_attn.sinks")]
    assert bool(sinks) == (stock.config.get_text_config().model_type == "gpt_oss")
    assert all(grads[name][0].norm() > 0 for name in sinks)


def test_packed_rows_match_stock_eager_attention_in_fp32(stock, trees):
    row = trees.random_row(2, vocab=512, prompts=2, rollouts=3, longest=50)
    alone = copy.deepcopy(stock)
    tree = copy.deepcopy(stock)
    enable_tree_attention(tree, "reference")
    assert_gradients_close(packed_and_alone_gradients(tree, alone, row, atol=2e-5), rtol=2e-4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_is_exact_in_fp64(stock, trees):
    """flex (forward only on CPU) with its per-window block masks and the sinks through its log-sum-exp, against
    each sample alone through the reference backend."""
    row = trees.random_row(3, vocab=512, prompts=2, rollouts=3, longest=50)
    tree = _double(stock)
    alone = copy.deepcopy(tree)
    enable_tree_attention(tree, "flex")
    enable_tree_attention(alone, "reference")
    with torch.no_grad():
        assert_packed_logprobs_match(
            row, lambda r: token_logprobs(tree, r), tree_alone_logprobs(alone), atol=1e-10, rtol=0
        )


def test_the_window_and_sinks_matter_to_these_rows(stock, trees):
    """The same rows with the window (and gpt-oss's sinks) switched off are visibly off: the tests above would
    catch a tree that dropped either."""
    row = trees.random_row(1, vocab=512, prompts=2, rollouts=3, longest=50)
    tree = copy.deepcopy(stock)
    enable_tree_attention(tree, "reference")
    blind = copy.deepcopy(tree)
    for module in blind.modules():
        if hasattr(module, "sliding_window"):
            module.sliding_window = None
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            module.sinks.data.fill_(-1e4)
    if hasattr(blind.config.get_text_config(), "sliding_window"):
        blind.config.get_text_config().sliding_window = None  # Mistral reads the config at every call
    with torch.no_grad():
        gap = (token_logprobs(tree, row) - token_logprobs(blind, row)).abs().max()
    assert gap > 1e-2
