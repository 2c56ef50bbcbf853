"""The backend table and the CPU-runnable backends, each against an independent dense-mask attention."""

from __future__ import annotations

import pytest
import torch

from agrpo_attention import (
    BackendUnavailableError,
    UnsupportedModelError,
    available_backends,
    build_tree_plan,
)
from agrpo_attention._attention_needs import AttentionNeeds
from agrpo_attention._backends import BACKENDS, resolve_backend


def dense_attention(q, k, v, mask, scaling, softcap=None):
    """Plain masked softmax attention over the whole row: (1, Hq, N, D) -> (1, N, Hq, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def random_qkv(row, seed, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n = row.num_tokens
    q = torch.randn(1, num_heads, n, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(1, num_kv_heads, n, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(1, num_kv_heads, n, head_dim, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_dense_masked_attention_with_gradients(trees, seed, softcap):
    row = trees.random_row(seed)
    q, k, v = random_qkv(row, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    plan = build_tree_plan(row, backend="reference")
    out = plan.attend(q, k, v, scaling=0.3, softcap=softcap)
    expected = dense_attention(q, k, v, trees.visibility_from_paths(row), 0.3, softcap)
    _assert_same_outputs_and_grads(out, expected, (q, k, v), grad_atol=1e-12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_flex_forward_equals_reference_on_cpu(trees, softcap):
    row = trees.random_row(7)
    q, k, v = random_qkv(row, 7, dtype=torch.float32)
    want = build_tree_plan(row, backend="reference").attend(q, k, v, softcap=softcap)
    with torch.no_grad():
        got = build_tree_plan(row, backend="flex").attend(q, k, v, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _assert_same_outputs_and_grads(out, expected, inputs, *, grad_atol: float, others=None) -> None:
    """fp64 outputs agree to 1e-12 and so do the gradients of a random projection w.r.t. `inputs` (for
    `expected`, w.r.t. `others` when it was computed from copies)."""
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weights).sum(), inputs if others is None else others)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=grad_atol)


def test_auto_on_cpu_is_reference_and_gpu_backends_refuse_clearly():
    assert resolve_backend("auto", "cpu").name == "reference"
    for name in ("varlen", "fa3", "fa4", "aiter"):
        with pytest.raises(BackendUnavailableError, match=f"backend='{name}' cannot run here"):
            resolve_backend(name, "cpu")


def test_unknown_backend_and_softcap_without_support_are_refused():
    with pytest.raises(BackendUnavailableError, match="unknown"):
        resolve_backend("flash", "cpu")
    assert not BACKENDS["varlen"].supports_softcap
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        resolve_backend("varlen", "cpu", needs=AttentionNeeds(softcap=True))
    assert resolve_backend("auto", "cpu", needs=AttentionNeeds(softcap=True)).supports_softcap


@pytest.mark.parametrize("seed", range(3))
def test_flex_block_mask_equals_create_block_mask_in_values_and_layout(trees, seed):
    from torch.nn.attention.flex_attention import create_block_mask

    from agrpo_attention._backends.flex import tree_block_mask
    from agrpo_attention._tree_layout import build_tree_layout

    row = trees.random_row(seed, vocab=512, prompts=3, longest=400)
    layout = build_tree_layout(row, "cpu")
    ends = layout.subtree_end
    want = create_block_mask(
        lambda b, h, q, kv: (kv <= q) & (q < ends[kv]),
        None,
        None,
        row.num_tokens,
        row.num_tokens,
        device="cpu",
    )
    got = tree_block_mask(layout)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.is_contiguous(), f"{name} must be row-major: the GPU kernel reads it so"
        counts = getattr(want, name.replace("indices", "num_blocks"))[0, 0]
        if name.endswith("indices"):  # only the first `count` entries of each row are meaningful
            for q_block, count in enumerate(counts.tolist()):
                assert torch.equal(a[0, 0, q_block, :count], b[0, 0, q_block, :count]), name
        else:
            assert torch.equal(a, b), name
    assert got.seq_lengths == want.seq_lengths


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_cascade_split_and_merge_equal_reference_with_gradients(trees, seed, share):
    """The cascade decomposition (own causal blocks + ancestor cross blocks, merged by log-sum-exp, backward
    with the merged output/lse) is exact; run with its plain-PyTorch kernel twin, which the CUDA path swaps
    for FA2's forward/backward."""
    from agrpo_attention._backends.cascade import build_cascade_state, cascade_attention
    from agrpo_attention._tree_layout import build_tree_layout

    row = trees.random_row(seed, share=share, vocab=512, prompts=3, longest=120)
    q, k, v = (x.requires_grad_() for x in random_qkv(row, seed))
    layout = build_tree_layout(row, "cpu")
    state = build_cascade_state(layout)
    assert (state.cross_q_index is None) == (not share)
    out = cascade_attention(q, k, v, layout, state, scaling=0.3)
    expected = build_tree_plan(row, backend="reference").attend(q, k, v, scaling=0.3)
    _assert_same_outputs_and_grads(out, expected, (q, k, v), grad_atol=1e-11)


def test_cascade_compiles_as_one_graph_with_the_same_outputs_and_gradients(trees):
    """Its custom ops are opaque to dynamo: a compiled function around cascade attention has no graph break,
    one graph serves rows with and without shared prefixes of several sizes, and output and gradients equal
    the eager call's (aot_eager, fp64 twin kernels on CPU). `opcheck` checks the op's fake and autograd."""
    from agrpo_attention._backends.cascade import _cascade_forward, build_cascade_state, cascade_attention
    from agrpo_attention._tree_layout import build_tree_layout

    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(cascade_attention, backend="aot_eager", dynamic=True, fullgraph=True)
    for seed in range(4):
        row = trees.random_row(seed, share=True, vocab=512, prompts=2 + seed, longest=60 + 20 * seed)
        layout = build_tree_layout(row, "cpu")
        state = build_cascade_state(layout)
        inputs = random_qkv(row, seed)
        eager_inputs = [x.clone().requires_grad_() for x in inputs]
        compiled_inputs = [x.clone().requires_grad_() for x in inputs]
        expected = cascade_attention(*eager_inputs, layout, state, scaling=0.3)
        got = compiled(*compiled_inputs, layout, state, scaling=0.3)
        _assert_same_outputs_and_grads(got, expected, compiled_inputs, grad_atol=1e-12, others=eager_inputs)
    assert counts["stats"]["unique_graphs"] <= 2, dict(counts["stats"])
    assert not counts["graph_break"], dict(counts["graph_break"])
    q, k, v = (x[0].transpose(0, 1).contiguous().requires_grad_() for x in random_qkv(row, 0))
    torch.library.opcheck(
        _cascade_forward,
        (q, k, v, layout.q_offsets, layout.max_q, state.cross_q_index, state.cross_k_index, state.cu_q,
         state.cu_k, state.max_q, state.max_k, 0.3),
    )  # fmt: skip


def test_cascade_refuses_cpu_clearly():
    with pytest.raises(BackendUnavailableError, match="backend='cascade' cannot run here"):
        resolve_backend("cascade", "cpu")


def test_adaptive_picks_varlen_for_rows_that_share_little_and_flex_for_rows_that_share_a_lot(trees):
    from agrpo_attention._backends.adaptive import FLEX_FROM_PATH_RATIO, AdaptiveBackend, path_ratio
    from agrpo_attention._tree_layout import build_tree_layout

    backend = AdaptiveBackend()
    flat = build_tree_layout(trees.random_row(0, share=False), "cpu")
    assert path_ratio(flat) == 1.0 and backend.choose(flat).name == "varlen"
    shared = build_tree_layout(trees.random_row(0, vocab=512, rollouts=8, longest=60), "cpu")
    assert backend.choose(shared).name == ("flex" if path_ratio(shared) >= FLEX_FROM_PATH_RATIO else "varlen")
    assert resolve_backend("auto", "cpu").name == "reference"
    with pytest.raises(BackendUnavailableError, match="backend='adaptive' cannot run here"):
        resolve_backend("adaptive", "cpu")


def test_available_backends_lists_what_can_train_and_forward_only_ones_on_request():
    """FlexAttention has no backward on CPU: it is listed for inference only, and the listing says so."""
    assert available_backends("cpu") == ["reference"]
    assert available_backends("cpu", training=False) == ["reference", "flex"]
    assert BACKENDS["flex"].forward_only_on == ("cpu",)
    assert all(not b.forward_only_on for name, b in BACKENDS.items() if name not in ("flex", "adaptive"))


def test_flex_on_cpu_really_has_no_backward_and_refuses_training_naming_reference(trees):
    """The listing above is a fact about torch (this test fails when torch adds a CPU backward), and
    training through flex on CPU is refused with the backend that trains there."""
    from torch.nn.attention.flex_attention import flex_attention

    row = trees.random_row(0, vocab=512)
    q, k, v = (x.requires_grad_() for x in random_qkv(row, 0, num_kv_heads=4, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, k, v)
    with pytest.raises(BackendUnavailableError, match="backend='reference'"):
        build_tree_plan(row, backend="flex").attend(q, k, v)


def test_auto_skips_backends_that_cannot_run_the_model_dtype(monkeypatch):
    """On CUDA a float32 model (no autocast) must not get a half-precision-only kernel: FA3 (made available
    here as if installed on Hopper) is skipped for adaptive, which runs float32 rows through flex."""
    from agrpo_attention._backends.fa3 import FA3Backend

    monkeypatch.setattr(FA3Backend, "unavailable_reason", lambda self, device: None)
    assert resolve_backend("auto", "cuda", dtype=torch.bfloat16).name == "fa3"
    assert resolve_backend("auto", "cuda", dtype=torch.float32).name == "adaptive"
    half = (torch.float16, torch.bfloat16)
    assert {n for n, b in BACKENDS.items() if b.input_dtypes == half} == {"varlen", "fa3", "fa4", "aiter"}
    assert all(BACKENDS[n].input_dtypes is None for n in ("reference", "flex", "cascade", "adaptive"))
    # an explicit name is not refused for float32 weights: autocast may cast q/k/v at run time
    assert resolve_backend("fa3", "cuda", dtype=torch.float32).name == "fa3"
