"""`enable_tree_attention`: what it switches, what it refuses (with messages naming the fix), and what it
leaves alone (the stock Gated DeltaNet forward without a plan; copies of an enabled model)."""

from __future__ import annotations

import copy

import pytest
import torch

from agrpo_attention import (
    TreePlanMissingError,
    UnsupportedModelError,
    build_tree_plan,
    deltanet_traceable,
    enable_tree_attention,
    token_logprobs,
)
from agrpo_packing.testing import assert_packed_logprobs_match


def test_enable_switches_attention_and_records_the_backend(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    assert enable_tree_attention(model, "auto") == "reference"
    assert model.config._attn_implementation == "agrpo_tree"
    assert enable_tree_attention(model, "reference") == "reference"  # idempotent


def test_auto_picks_by_the_model_dtype(cuda_like, tiny_dense, monkeypatch):
    """The selection `enable_tree_attention` makes on CUDA, on CPU: a half-precision-only backend first in
    the auto order is taken for a bf16 model and skipped for a float32 one."""
    from agrpo_attention._backends import AUTO_ORDER

    monkeypatch.setitem(AUTO_ORDER, "cpu", ("varlen", "reference"))
    assert enable_tree_attention(copy.deepcopy(tiny_dense), "auto") == "reference"
    assert enable_tree_attention(copy.deepcopy(tiny_dense).to(torch.bfloat16), "auto") == "varlen"


def test_forward_without_a_plan_and_logprobs_before_enabling_are_refused(tiny_dense, trees):
    row = trees.random_row(0, vocab=512)
    with pytest.raises(ValueError, match="enable_tree_attention"):
        token_logprobs(tiny_dense, row)
    model = copy.deepcopy(tiny_dense)
    enable_tree_attention(model)
    with pytest.raises(TreePlanMissingError, match="token_logprobs"):
        model(input_ids=row.input_ids[None])
    with pytest.raises(ValueError, match="takes backend, device and windows from the model"):
        build_tree_plan(row, model, backend="flex")
    with pytest.raises(ValueError, match="not built for this model"):
        token_logprobs(model, row, plan=build_tree_plan(row, backend="flex"))


def test_prebuilt_plan_gives_the_same_logprobs(tiny_dense, trees):
    row = trees.random_row(1, vocab=512)
    model = copy.deepcopy(tiny_dense)
    enable_tree_attention(model)
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(model, row, plan=build_tree_plan(row, model)), token_logprobs(model, row)
        )


def test_patched_deltanet_runs_its_stock_forward_without_a_plan_and_copies_stay_independent(tiny_hybrid):
    model = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(model)
    hidden = torch.randn(1, 9, tiny_hybrid.config.hidden_size)
    with torch.no_grad():
        stock = tiny_hybrid.model.layers[0].linear_attn(hidden_states=hidden)
        torch.testing.assert_close(model.model.layers[0].linear_attn(hidden_states=hidden), stock)
        clone = copy.deepcopy(model)
        clone.model.layers[0].linear_attn.out_proj.weight.mul_(2)
        torch.testing.assert_close(model.model.layers[0].linear_attn(hidden_states=hidden), stock)
        torch.testing.assert_close(clone.model.layers[0].linear_attn(hidden_states=hidden), 2 * stock)


def test_unsupported_layer_types_and_mixers_are_refused(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="layer 0 is 'chunked_attention'"):
        enable_tree_attention(model)

    class FakeMambaMixer(torch.nn.Module):
        pass

    model = copy.deepcopy(tiny_dense)
    model.model.layers[0].mixer = FakeMambaMixer()
    with pytest.raises(UnsupportedModelError, match="FakeMambaMixer"):
        enable_tree_attention(model)


def test_attention_dropout_while_training_is_refused(tiny_dense, trees):
    model = copy.deepcopy(tiny_dense)
    enable_tree_attention(model)
    model.model.layers[0].self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(UnsupportedModelError, match="attention_dropout"):
        token_logprobs(model, trees.random_row(2, vocab=512))


def tiny_softcap_model():
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["full_attention"] * 2, attn_logit_softcapping=0.5,
        final_logit_softcapping=3.0, query_pre_attn_scalar=16, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_softcapping_runs_where_supported_and_is_refused_elsewhere(trees):
    stock = tiny_softcap_model()
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        enable_tree_attention(copy.deepcopy(stock), "varlen")
    model = copy.deepcopy(stock)
    assert enable_tree_attention(model) == "reference"
    row = trees.random_row(3, vocab=64)

    def alone(input_ids):
        logits = stock(input_ids=input_ids[None]).logits[0, :-1]
        return logits.log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]

    with torch.no_grad():
        assert_packed_logprobs_match(row, lambda r: token_logprobs(model, r), alone)


def test_deltanet_traceable_only_on_the_kernel_whose_tree_forward_is_custom_ops(
    tiny_hybrid, tiny_dense, monkeypatch
):
    """A compiled layer traces a Gated DeltaNet tree forward whole only with deltanet_kernel "triton" (one custom op
    for the tree, one for the convolution); "torch" loops over the tree's levels; dense or not-enabled models: no."""
    from agrpo_attention import _tree_deltanet

    assert not deltanet_traceable(tiny_hybrid)  # not enabled yet
    torch_kernel = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(torch_kernel, "reference", deltanet_kernel="torch")
    assert not deltanet_traceable(torch_kernel)
    monkeypatch.setitem(_tree_deltanet._UNAVAILABLE_REASON, "triton", lambda device: None)  # as on a GPU
    triton_kernel = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(triton_kernel, "reference", deltanet_kernel="triton")
    assert deltanet_traceable(triton_kernel)
    dense = copy.deepcopy(tiny_dense)
    enable_tree_attention(dense, "reference")
    assert not deltanet_traceable(dense)
