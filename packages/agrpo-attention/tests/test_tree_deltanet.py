"""Tree Gated DeltaNet: every segment's output equals running its root-to-segment path alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from agrpo_attention import BackendUnavailableError, UnsupportedModelError
from agrpo_attention._delta_rule_torch import chunk_gated_delta_rule
from agrpo_attention._deltanet_plan import build_deltanet_plan
from agrpo_attention._tree_deltanet import (
    _UNAVAILABLE_REASON,
    check_deltanet_module,
    path_conv,
    resolve_delta_rule_kernel,
    tree_delta_rule,
    tree_deltanet_forward,
)


def segment_paths(row):
    """(path positions, number of own tokens at its end, own positions) per segment."""
    for s in range(row.num_segments):
        q0, q1 = int(row.q_offsets[s]), int(row.q_offsets[s + 1])
        yield row.kv_index[int(row.kv_offsets[s]) : int(row.kv_offsets[s + 1])], q1 - q0, slice(q0, q1)


@pytest.mark.parametrize("seed", range(3))
def test_tree_delta_rule_equals_each_path_alone_with_gradients_fp64(trees, seed):
    row = trees.random_row(seed, vocab=3)
    n, gen = row.num_tokens, torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs = [rand(1, n, 2, 8), rand(1, n, 2, 8), rand(1, n, 4, 6)]
    inputs += [
        -4 * torch.rand(1, n, 4, generator=gen, dtype=torch.float64),
        torch.rand(1, n, 4, generator=gen).double(),
    ]
    inputs = [x.requires_grad_() for x in inputs]
    out = tree_delta_rule(*inputs, build_deltanet_plan(row, 4, "cpu"), "torch")
    weights = torch.randn_like(out)
    expected = torch.zeros_like(out)
    for path, own, positions in segment_paths(row):
        alone, _ = chunk_gated_delta_rule(*(x[:, path] for x in inputs))
        expected[:, positions] = alone[:, -own:]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad((out * weights).sum(), inputs)
    want = torch.autograd.grad((expected * weights).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_path_conv_equals_causal_conv_along_each_path(trees):
    row = trees.random_row(5, vocab=3)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3, bias=False).double()
    mixed = torch.randn(row.num_tokens, 6, dtype=torch.float64)
    out = path_conv(mixed, conv, build_deltanet_plan(row, 4, "cpu"), "silu")
    for path, own, positions in segment_paths(row):
        alone = F.silu(conv(mixed[path].t().unsqueeze(0))[0, :, : len(path)]).t()
        torch.testing.assert_close(out[positions], alone[-own:], rtol=1e-12, atol=1e-12)


def qwen3_next_layer_of_three_key_heads():
    """transformers' Qwen3-Next Gated DeltaNet with 3 key heads of 2 value heads each: the fused projections'
    per-key-head groups ([q k v v z z] per key head, then [b b a a]) differ from a flat split."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(3)
    config = Qwen3NextConfig(hidden_size=24, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=8,
                             linear_value_head_dim=4, linear_conv_kernel_dim=4)  # fmt: skip
    return Qwen3NextGatedDeltaNet(config, layer_idx=0)


@pytest.mark.parametrize("kind", ["tiny_hybrid", "tiny_qwen3_next", "three_key_heads"])
def test_tree_forward_of_a_real_layer_equals_its_stock_forward_on_each_path(trees, request, kind):
    """Both projection layouts: Qwen3.5's separate projections and Qwen3-Next's fused, per-key-head grouped
    in_proj_qkvz / in_proj_ba (several value heads per key head and several key heads, so a wrong regrouping
    shows)."""
    if kind == "three_key_heads":
        layer = qwen3_next_layer_of_three_key_heads()
    else:
        layer = request.getfixturevalue(kind).model.layers[0].linear_attn
    row = trees.random_row(2, vocab=3)
    hidden_size = layer.out_proj.out_features
    hidden = torch.randn(1, row.num_tokens, hidden_size, generator=torch.Generator().manual_seed(0))
    plan = build_deltanet_plan(row, int(layer.conv1d.weight.shape[-1]), "cpu")
    with torch.no_grad():
        out = tree_deltanet_forward(layer, hidden, plan, "torch")
        for path, own, positions in segment_paths(row):
            alone = layer(hidden_states=hidden[:, path])
            torch.testing.assert_close(out[:, positions], alone[:, -own:], rtol=1e-5, atol=1e-5)


def test_kernel_choice_and_layout_check_refuse_clearly():
    assert resolve_delta_rule_kernel("auto", torch.device("cpu")) == "torch"
    with pytest.raises(BackendUnavailableError, match="fla"):
        resolve_delta_rule_kernel("fla", torch.device("cpu"))
    with pytest.raises(BackendUnavailableError, match="triton.*needs a CUDA GPU"):
        resolve_delta_rule_kernel("triton", torch.device("cpu"))
    with pytest.raises(BackendUnavailableError, match="expected 'auto'"):
        resolve_delta_rule_kernel("cuda", torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match=r"layers.0.linear_attn \(Linear\).*Qwen3.5.*Qwen3-Next"):
        check_deltanet_module(torch.nn.Linear(2, 2), "model.layers.0.linear_attn")


def test_a_layout_half_fused_is_refused_naming_both_layouts(tiny_qwen3_next):
    """A Gated DeltaNet with the fused qkvz projection but no in_proj_ba (neither layout) is refused whole."""
    layer = copy.deepcopy(tiny_qwen3_next.model.layers[0].linear_attn)
    del layer.in_proj_ba
    with pytest.raises(
        UnsupportedModelError, match=r"in_proj_qkvz/in_proj_ba\): \['in_proj_qkvz', 'in_proj_ba'"
    ):
        check_deltanet_module(layer, "model.layers.0.linear_attn")


@pytest.mark.parametrize(
    ("fla_runs", "triton_runs", "chosen"),
    [(True, True, "fla"), (False, True, "triton"), (False, False, "torch")],
)
def test_auto_prefers_fla_then_our_triton_then_torch(monkeypatch, fla_runs, triton_runs, chosen):
    reasons = {"fla": None if fla_runs else "no fla", "triton": None if triton_runs else "no triton"}
    for name, reason in reasons.items():
        monkeypatch.setitem(_UNAVAILABLE_REASON, name, lambda device, reason=reason: reason)
    assert resolve_delta_rule_kernel("auto", torch.device("cuda")) == chosen
