"""Sliding windows and attention sinks in every backend that claims them, against a dense masked softmax that
reads the definition literally: query i sees key j iff j is on i's root-to-token path and
depth(i) - window < depth(j) <= depth(i) (transformers' and vLLM's window), and a sink is one more logit per
head in each softmax that carries no value (gpt-oss). Boundaries: a window of 1, windows shorter than a shared
prompt, windows that cross segment boundaries, windows longer than every row; flex's block lists are checked
exact against the dense mask (every block with a visible pair is listed, no block listed as full has a hidden
pair)."""

from __future__ import annotations

import pytest
import torch

from agrpo_attention import UnsupportedModelError, build_tree_plan
from agrpo_attention._attention_needs import AttentionNeeds
from agrpo_attention._backends import BACKENDS, resolve_backend
from agrpo_attention._backends.flex import _BLOCK, _window_block_pairs
from agrpo_attention._tree_layout import build_tree_layout

WINDOWS = [1, 3, 17, 60, 100_000]
"""A window of one token, shorter than the prompts (prompts span 3..35 tokens), crossing segment boundaries
(completions of 1..70 tokens under a prompt), and longer than every row."""


def windowed_visibility(trees, row, window: int | None) -> torch.Tensor:
    """(N, N) bool: the tree's visibility, cut to the last `window` tokens of each path by the row's position ids."""
    visible = trees.visibility_from_paths(row)
    if window is None:
        return visible
    depth = row.position_ids.long()
    return visible & (depth[:, None] - depth[None, :] < window)


def dense_attention(q, k, v, mask, scaling, sinks=None):
    """Masked softmax over the whole row, a sink column per head when given: (1, Hq, N, D) -> (1, N, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ v).transpose(1, 2)
    sink_column = sinks[None, :, None, None].expand(1, -1, scores.shape[2], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


def random_inputs(row, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n = row.num_tokens
    q = torch.randn(1, 4, n, 16, generator=gen, dtype=dtype)
    k = torch.randn(1, 2, n, 16, generator=gen, dtype=dtype)
    v = torch.randn(1, 2, n, 16, generator=gen, dtype=dtype)
    sinks = torch.randn(4, generator=gen, dtype=dtype) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_reference_equals_dense_windowed_attention_with_sinks_and_gradients(trees, window, with_sinks):
    row = trees.random_row(window or 0, longest=120)
    q, k, v, sinks = (x.requires_grad_() for x in random_inputs(row, 1))
    sinks_in = sinks if with_sinks else None
    out = build_tree_plan(row, backend="reference").attend(
        q, k, v, scaling=0.3, window=window, sinks=sinks_in
    )
    want = dense_attention(q, k, v, windowed_visibility(trees, row, window), 0.3, sinks_in)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    inputs = (q, k, v, sinks) if with_sinks else (q, k, v)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    for g, expected in zip(got, torch.autograd.grad(want, inputs, grad), strict=True):
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-11)
    if with_sinks:
        assert float(got[-1].abs().min()) > 1e-3  # every head's sink gets a gradient


@pytest.mark.parametrize("window", [None, 3, 60])
def test_the_hand_written_backward_with_window_and_sinks_equals_autograd(trees, window):
    """The backward the compiled path's custom op runs (`attend_backward`), sinks' gradient included."""
    row = trees.random_row(5, longest=100)
    q, k, v, sinks = (x.requires_grad_() for x in random_inputs(row, 2))
    reference = BACKENDS["reference"]
    layout = build_tree_layout(row, "cpu")
    out = reference.attend(q, k, v, layout, None, scaling=0.25, softcap=4.0, window=window, sinks=sinks)
    grad = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v, sinks), grad)
    detached = (x.detach() for x in (q, k, v))
    got = reference.attend_backward(
        grad, *detached, layout, None, scaling=0.25, softcap=4.0, window=window, sinks=sinks.detach()
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_flex_forward_with_windows_and_sinks_equals_dense_on_cpu(trees, window, with_sinks):
    row = trees.random_row(11, longest=150)
    q, k, v, sinks = random_inputs(row, 3, dtype=torch.float32)
    sinks_in = sinks if with_sinks else None
    plan = build_tree_plan(row, backend="flex", windows=() if window is None else (window,))
    with torch.no_grad():
        got = plan.attend(q, k, v, scaling=0.3, window=window, sinks=sinks_in)
    want = dense_attention(q, k, v, windowed_visibility(trees, row, window), 0.3, sinks_in)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 60, 129, 256, 400])
def test_flex_window_block_lists_are_exact(trees, window):
    """A windowed layer's block mask lists every (query block, key block) with a visible pair and no other, and
    marks full (mask skipped) only blocks whose every pair is visible: the kernel reads what the window attends."""
    row = trees.random_row(window, prompts=3, longest=900)
    layout = build_tree_layout(row, "cpu")
    listed, full = (torch.from_numpy(x) for x in _window_block_pairs(layout, window))
    n, blocks = row.num_tokens, listed.shape[0]
    mask = torch.zeros(blocks * _BLOCK, blocks * _BLOCK, dtype=torch.bool)
    mask[:n, :n] = windowed_visibility(trees, row, window)
    inside = torch.zeros_like(mask)
    inside[:n, :n] = True
    by_block = mask.view(blocks, _BLOCK, blocks, _BLOCK).permute(2, 0, 3, 1)  # (kv block, q block, k, q)
    inside_blocks = inside.view(blocks, _BLOCK, blocks, _BLOCK).permute(2, 0, 3, 1)
    assert torch.equal(listed, by_block.any(-1).any(-1))
    really_full = (by_block | ~inside_blocks).all(-1).all(-1) & inside_blocks.all(-1).all(-1)
    assert not (full & ~really_full).any()
    if window >= 2 * _BLOCK:  # a block can be wholly visible only when the window spans two blocks
        assert full.sum() >= 0.6 * really_full.sum() > 0  # blocks inside one segment pair are all found


@pytest.mark.parametrize("window", [None, 3, 60])
def test_varlen_runs_windows_through_its_window_size(cuda_like, trees, window):
    """The gathered-path varlen call (its CPU twin has FA2's window contract) equals the reference in bf16."""
    row = trees.random_row(4, longest=100)
    q, k, v, _ = random_inputs(row, 4, dtype=torch.bfloat16)
    windows = () if window is None else (window,)
    got = build_tree_plan(row, backend="varlen", windows=windows).attend(q, k, v, scaling=0.3, window=window)
    want = build_tree_plan(row, backend="reference").attend(q, k, v, scaling=0.3, window=window)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)


def test_backends_without_windows_or_sinks_are_refused_naming_the_layer_and_auto_passes_them_over(cuda_like):
    windowed = AttentionNeeds(windows=(4096,), windowed_layer="model.layers.0.self_attn")
    with_sinks = AttentionNeeds(
        windows=(128,), sinks=True, windowed_layer="l0", sink_layer="model.layers.1.self_attn"
    )
    with pytest.raises(
        UnsupportedModelError, match=r"model\.layers\.0\.self_attn uses a sliding window of 4096"
    ):
        resolve_backend("cascade", "cpu", needs=windowed)
    with pytest.raises(
        UnsupportedModelError, match=r"model\.layers\.1\.self_attn has learned attention sinks"
    ):
        resolve_backend("varlen", "cpu", needs=with_sinks)
    assert resolve_backend("varlen", "cpu", needs=windowed).name == "varlen"
    assert [n for n, b in BACKENDS.items() if with_sinks.unmet_by(b) is None] == [
        "reference",
        "flex",
        "adaptive",
    ]
    assert resolve_backend("auto", "cpu", needs=with_sinks).name == "reference"


def test_adaptive_sends_every_row_with_sinks_through_flex(cuda_like, trees):
    row = trees.random_row(1, longest=40, share=False)  # unshared: adaptive would choose varlen
    adaptive = BACKENDS["adaptive"]
    layout = build_tree_layout(row, "cpu")
    assert adaptive.prepare(layout).backend.name == "varlen"
    assert adaptive.prepare(layout, windows=(8,), sinks=True).backend.name == "flex"


def test_a_kernel_handed_a_window_it_lacks_refuses_instead_of_dropping_it(trees):
    row = trees.random_row(2, longest=40)
    q, k, v, sinks = random_inputs(row, 0, dtype=torch.float32)
    layout = build_tree_layout(row, "cpu")
    with pytest.raises(UnsupportedModelError, match="does not implement a sliding window"):
        BACKENDS["cascade"].attend(q, k, v, layout, None, scaling=0.3, softcap=None, window=8)
    with pytest.raises(UnsupportedModelError, match="does not implement attention sinks"):
        BACKENDS["varlen"].attend(q, k, v, layout, None, scaling=0.3, softcap=None, sinks=sinks)


@pytest.mark.parametrize("window", [None, 7])
def test_layout_counts_the_pairs_a_window_attends(trees, window):
    row = trees.random_row(3, longest=90)
    layout = build_tree_layout(row, "cpu")
    want = int(windowed_visibility(trees, row, window).sum())
    assert layout.score_pairs_within(window) == want
    assert layout.score_pairs == int(trees.visibility_from_paths(row).sum())
