"""The packing invariant end to end: a packed row forwarded through a stock decoder gives every loss
term the log-prob (and every parameter the gradient) it gets when each sample is forwarded alone.

Rows come from agrpo-packing's hypothesis strategy and seeded GRPO generator; the "alone" side is the
stock transformers model, untouched. fp32 tolerances: log-probs 1e-5, parameter gradients 1e-4
relative (L2 per tensor). One exception, measured and asserted below: the gradients of the Gated
DeltaNet gate parameters (A_log, dt_bias, in_proj_a) suffer catastrophic cancellation in fp32 in the
chunked delta rule itself, so transformers' own per-sample fp32 gradients sit ~1e-3 from the fp64
truth; for those we show exactness in fp64 and that our fp32 error is no worse than the stock one. Both
Gated DeltaNet layouts run these checks: Qwen3.5's (`tiny_hybrid`) and Qwen3-Next's (`tiny_qwen3_next`: fused
projections, gated attention, MoE with a shared expert; fp64 runs its experts with transformers' "eager"
experts implementation, as torch's grouped_mm takes no fp64).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from agrpo_attention import _token_logprobs as token_logprobs_module
from agrpo_attention import (
    build_tree_plan,
    enable_tree_attention,
    gathered_logprobs,
    token_logprobs,
    token_scores,
)
from agrpo_packing import PackSample, TreeRow
from agrpo_packing.testing import assert_packed_logprobs_match, assert_row_layout, grpo_groups

GATE_PARAMETERS = ("A_log", "dt_bias", "in_proj_a", "in_proj_ba")  # Qwen3-Next fuses b and a in in_proj_ba


def stock_sequence_logprobs(model):
    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=input_ids[None]).logits[0, :-1]
        return logits.to(torch.float64).log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]

    return sequence_logprobs


def tree_sequence_logprobs(model):
    """A sample forwarded alone through the tree-enabled model itself (a one-sample row)."""

    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(input_ids.shape[0], dtype=torch.bool)
        mask[0] = False
        num = input_ids.shape[0] - 1
        row = TreeRow(0)
        row.add(
            PackSample(
                input_ids=input_ids.numpy(),
                trained_mask=mask.numpy(),
                group_id=0,
                advantages=torch.zeros(num).numpy(),
                sampler_logprobs=torch.zeros(num).numpy(),
            )
        )
        packed = row.pack()
        order = packed.position_ids[packed.token_index].argsort()
        return token_logprobs(model, packed)[order]

    return sequence_logprobs


def packed_and_alone_gradients(tree_model, alone_model, row, alone, atol):
    """Check log-probs, then return {name: (packed grad, alone grad)} of a random weighting of the terms."""
    tree_model.zero_grad()
    alone_model.zero_grad()
    packed, reference = assert_packed_logprobs_match(
        row, lambda r: token_logprobs(tree_model, r), alone(alone_model), atol=atol, rtol=0
    )
    weights = torch.randn(row.num_loss_terms, generator=torch.Generator().manual_seed(row.num_tokens))
    (packed.double() * weights).sum().backward()
    (reference.double() * weights).sum().backward()
    pairs = zip(tree_model.named_parameters(), alone_model.named_parameters(), strict=True)
    return {name: (_grad(p), _grad(q)) for (name, p), (_, q) in pairs}


def _grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    return (
        torch.zeros_like(parameter, dtype=torch.float64)
        if parameter.grad is None
        else parameter.grad.double()
    )


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_gradients_close(grads, rtol: float, gate_rtol: float | None = None) -> None:
    """Per tensor: |packed - alone| <= rtol |alone| + 1e-7 x the largest gradient norm (a gradient that is
    zero up to rounding, e.g. the query of a one-token context, has no meaningful relative error)."""
    floor = 1e-7 * max(float(alone.norm()) for _, alone in grads.values()) + 1e-12
    for name, (packed, alone) in grads.items():
        is_gate = name.removesuffix(".weight").rsplit(".", 1)[-1] in GATE_PARAMETERS
        tolerance = gate_rtol if is_gate and gate_rtol is not None else rtol
        error = float((packed - alone).norm())
        assert error <= tolerance * float(alone.norm()) + floor, (
            f"{name}: {error:.3g} vs |alone| {float(alone.norm()):.3g}"
        )


@pytest.fixture(scope="module")
def tree_dense(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    assert enable_tree_attention(model) == "reference"
    return model


@pytest.fixture(scope="module")
def tree_hybrid(tiny_hybrid):
    model = copy.deepcopy(tiny_hybrid)
    enable_tree_attention(model, "reference")
    return model


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=grpo_groups(max_completion_tokens=12, vocab_size=5))
def test_dense_packed_equals_alone_logprobs_and_gradients(tree_dense, tiny_dense, samples):
    row = TreeRow(0)
    row.extend(samples)
    packed_row = row.pack()
    assert_row_layout(packed_row, samples)
    assume(packed_row.num_loss_terms > 0)
    grads = packed_and_alone_gradients(tree_dense, tiny_dense, packed_row, stock_sequence_logprobs, 1e-5)
    assert_gradients_close(grads, rtol=1e-4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(samples=grpo_groups(max_prompt_tokens=40, max_completion_tokens=50, vocab_size=5))
def test_hybrid_packed_equals_alone_logprobs_and_gradients_fp32(tree_hybrid, tiny_hybrid, samples):
    row = TreeRow(0)
    row.extend(samples)
    packed_row = row.pack()
    assume(packed_row.num_loss_terms > 0)
    grads = packed_and_alone_gradients(tree_hybrid, tiny_hybrid, packed_row, stock_sequence_logprobs, 1e-5)
    assert_gradients_close(grads, rtol=1e-4, gate_rtol=1e-2)


def double(model):
    """An fp64 copy of `model` (MoE experts through plain matmuls: torch's grouped_mm has no fp64)."""
    model = copy.deepcopy(model).double()
    if hasattr(model, "set_experts_implementation") and getattr(model.config, "num_experts", None):
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize(("kind", "seed"), [("tiny_hybrid", 0), ("tiny_hybrid", 1), ("tiny_qwen3_next", 0)])
def test_hybrid_tree_is_exact_in_fp64_and_no_less_accurate_than_stock_in_fp32(trees, request, kind, seed):
    stock = request.getfixturevalue(kind)
    row = trees.random_row(seed, vocab=512, prompts=2, rollouts=3, longest=90)
    tree64 = double(stock)
    enable_tree_attention(tree64, "reference")
    alone64 = copy.deepcopy(tree64)
    grads64 = packed_and_alone_gradients(tree64, alone64, row, tree_sequence_logprobs, 1e-10)
    assert_gradients_close(grads64, rtol=1e-6)  # fp32 casts inside transformers' norms set this floor
    tree32 = copy.deepcopy(stock)
    enable_tree_attention(tree32, "reference")
    grads32 = packed_and_alone_gradients(tree32, stock, row, stock_sequence_logprobs, 1e-5)
    for name, (packed, stock) in grads32.items():
        truth = grads64[name][1]
        assert relative(packed, truth) <= 2 * relative(stock, truth) + 1e-4, name


def test_qwen3_next_packed_equals_its_stock_forward_alone_with_router_loss(trees, tiny_qwen3_next):
    """fp32, against the untouched transformers model: log-probs within 1e-5, gradients within 1e-4 (the gate
    projection's 1e-2, see the module docstring); the router aux loss of a one-sample row equals the stock one."""
    row = trees.random_row(3, vocab=512, prompts=2, rollouts=3, longest=60)
    tree = copy.deepcopy(tiny_qwen3_next)
    enable_tree_attention(tree, "reference")
    grads = packed_and_alone_gradients(tree, tiny_qwen3_next, row, stock_sequence_logprobs, 1e-5)
    assert_gradients_close(grads, rtol=1e-4, gate_rtol=1e-2)
    assert grads["model.layers.0.linear_attn.in_proj_qkvz.weight"][0].norm() > 0
    ids = torch.arange(3, 40)
    one = TreeRow(0)
    one.add(PackSample(input_ids=ids.numpy(), trained_mask=(ids > 3).numpy(), group_id=0,
                       advantages=np.ones(36), sampler_logprobs=np.zeros(36)))  # fmt: skip
    packed_row = one.pack()  # the last token is only a target: the row forwards the 36 before it
    with torch.no_grad():
        packed = token_scores(tree, packed_row, router_aux_loss=True).aux_loss
        direct = tiny_qwen3_next(
            input_ids=packed_row.input_ids[None], use_cache=False, output_router_logits=True
        ).aux_loss
    torch.testing.assert_close(packed, direct, rtol=1e-5, atol=1e-7)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_qwen3_next_flex_forward_is_exact_in_fp64(trees, tiny_qwen3_next):
    """The flex backend (forward-only on CPU) on Qwen3-Next's gated attention layer, beside its Gated DeltaNet
    layers: packed equals each sample alone through the tree model, fp64."""
    row = trees.random_row(5, vocab=512, prompts=2, rollouts=3, longest=60)
    model = double(tiny_qwen3_next)
    enable_tree_attention(model, "flex")
    with torch.no_grad():
        assert_packed_logprobs_match(
            row, lambda r: token_logprobs(model, r), tree_sequence_logprobs(model), atol=1e-10, rtol=0
        )


def test_a_row_without_loss_terms_gives_an_empty_differentiable_result(tree_dense):
    row = TreeRow(0)
    row.add(
        PackSample(
            input_ids=[3, 4, 5], trained_mask=[False] * 3, group_id=0, advantages=[], sampler_logprobs=[]
        )
    )
    logprobs = token_logprobs(tree_dense, row.pack())
    assert logprobs.shape == (0,) and logprobs.dtype == torch.float32
    tree_dense.zero_grad()
    logprobs.sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in tree_dense.parameters())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_forward_matches_on_cpu(trees, tiny_dense):
    row = trees.random_row(4, vocab=512)
    model = copy.deepcopy(tiny_dense)
    enable_tree_attention(model, "flex")
    with torch.no_grad():
        assert_packed_logprobs_match(
            row, lambda r: token_logprobs(model, r), stock_sequence_logprobs(tiny_dense)
        )


def test_gathered_logprobs_gradcheck_chunked_and_tempered(monkeypatch):
    monkeypatch.setattr(token_logprobs_module, "_CHUNK_BYTES", 4 * 11 * 3)  # 3 rows per chunk
    logits = torch.randn(10, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (10,))
    got = gathered_logprobs(logits, targets, temperature=0.7)
    want = (logits / 0.7).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, want)
    torch.autograd.gradcheck(lambda x: gathered_logprobs(x, targets, 0.7), (logits,))


# token_scores: the sampler's top-K log-probs, the sampling-set logsumexp and the MoE router aux loss, each
# against a full (M, V) log_softmax (or a stock forward) computed directly.


def with_sampler_data(samples, seed: int, vocab: int = 512, top_k: int = 5):
    """The samples with random sampler top-K ids (-1 padded at random widths) and sampling sets (some empty)."""
    rng = np.random.default_rng(seed)
    out = []
    for sample in samples:
        targets = sample.input_ids[sample.trained_mask]
        top_ids = np.stack([rng.choice(vocab, top_k, replace=False) for _ in targets]).reshape(-1, top_k)
        for row, width in zip(top_ids, rng.integers(0, top_k + 1, len(targets)), strict=True):
            row[width:] = -1
        sets = [
            np.zeros(0, np.int64)
            if rng.random() < 0.2
            else np.union1d(t, rng.choice(vocab, rng.integers(1, 40)))
            for t in targets
        ]
        top_logprobs = np.where(top_ids >= 0, -rng.exponential(size=top_ids.shape), -np.inf)
        out.append(
            dataclasses.replace(
                sample, sampler_top_ids=top_ids, sampler_top_logprobs=top_logprobs, sampling_mask=sets
            )
        )
    return out


def direct_scores(model, row, temperature: float):
    """The same outputs from the model's full logits: log_softmax over V, then plain gathers and a loop."""
    logits = model(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        use_cache=False,
        logits_to_keep=row.token_index,
        tree_plan=build_tree_plan(row, model),
    ).logits[0]
    logprobs_MV = (logits / temperature).log_softmax(-1)
    ids = row.sampler_top_ids
    top = torch.where(ids >= 0, logprobs_MV.gather(1, ids.clamp(min=0)), -torch.inf)
    offsets = row.sampling_mask_offsets.tolist()
    sets = [
        logprobs_MV[m, row.sampling_mask_ids[offsets[m] : offsets[m + 1]]].logsumexp(0)
        if offsets[m + 1] > offsets[m]
        else logprobs_MV.new_zeros(())
        for m in range(row.num_loss_terms)
    ]
    return logprobs_MV.gather(1, row.targets[:, None])[:, 0], top, torch.stack(sets)


def weighted_gradients(model, outputs, weights):
    model.zero_grad()
    logprobs, top, sets = outputs
    top = torch.where(torch.isfinite(top), top, 0.0)
    (weights[0] * logprobs + (weights[1] * top).sum(1) + weights[2] * sets).sum().backward()
    return {name: _grad(p) for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("dtype", "atol", "rtol"), [(torch.float64, 1e-10, 1e-8), (torch.float32, 2e-5, 1e-4)]
)
def test_token_scores_match_a_full_log_softmax_with_gradients(
    tiny_dense, trees, monkeypatch, dtype, atol, rtol
):
    monkeypatch.setattr(token_logprobs_module, "_CHUNK_BYTES", 4 * 512 * 7)  # 7 rows per chunk
    model = copy.deepcopy(tiny_dense).to(dtype)
    enable_tree_attention(model, "reference")
    row = TreeRow(0)
    row.extend(with_sampler_data(trees.seeded_samples(3, vocab=512), seed=3))
    packed = row.pack()
    assert packed.num_loss_terms > 3 * 7 and (packed.sampler_top_ids < 0).any()
    assert (packed.sampling_mask_offsets.diff() == 0).any()
    scores = token_scores(model, packed, temperature=0.7, top_ids=True, candidate_sets=True)
    got = (scores.logprobs, scores.top_logprobs, scores.candidate_logsumexp)
    want = direct_scores(model, packed, 0.7)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=0)
    assert torch.equal(scores.top_logprobs == -torch.inf, packed.sampler_top_ids < 0)
    assert scores.aux_loss is None
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s.shape, generator=generator, dtype=dtype) for s in want]
    got_grads = weighted_gradients(model, got, weights)
    want_grads = weighted_gradients(model, want, weights)
    assert_gradients_close({name: (got_grads[name], want_grads[name]) for name in got_grads}, rtol=rtol)


def test_gathered_columns_and_set_logsumexp_gradcheck_chunked_and_tempered(monkeypatch):
    monkeypatch.setattr(token_logprobs_module, "_CHUNK_BYTES", 4 * 11 * 3)  # 3 rows per chunk
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.randint(0, 11, (8, 4), generator=generator)
    ids[1, 2:] = ids[5, 1:] = -1
    set_ids = torch.stack([torch.randperm(11, generator=generator)[:5] for _ in range(8)])
    set_ids[2, 3:] = -1
    set_ids[6] = -1  # an empty set: no renormalisation, 0
    logprobs = (logits.detach() / 0.7).log_softmax(-1)
    want_sets = [logprobs[m, set_ids[m][set_ids[m] >= 0]].logsumexp(0) if m != 6 else 0.0 for m in range(8)]

    def scores(x):
        gathered, sets = token_logprobs_module._GatheredLogSoftmax.apply(x, ids, set_ids, 0.7)
        return torch.where(ids >= 0, gathered, 0.0), sets

    gathered, sets = scores(logits)
    torch.testing.assert_close(gathered, torch.where(ids >= 0, logprobs.gather(1, ids.clamp(min=0)), 0.0))
    torch.testing.assert_close(sets, torch.tensor(want_sets, dtype=torch.float64))
    torch.autograd.gradcheck(scores, (logits,))
    assert torch.equal(gathered_logprobs(logits, ids, 0.7) == -torch.inf, ids < 0)


def test_token_logprobs_is_the_first_field_of_token_scores(tree_dense, trees):
    row = trees.random_row(5, vocab=512)
    with torch.no_grad():
        scores = token_scores(tree_dense, row, candidate_sets=True)
        assert torch.equal(token_logprobs(tree_dense, row), scores.logprobs)
    assert scores.top_logprobs is None and scores.candidate_logsumexp is None  # the row carries no sets


def test_empty_row_gives_empty_differentiable_scores(tree_dense):
    row = TreeRow(0)
    row.add(
        PackSample(
            input_ids=[3, 4, 5],
            trained_mask=[False] * 3,
            group_id=0,
            advantages=[],
            sampler_logprobs=[],
            sampler_top_ids=np.zeros((0, 4)),
            sampler_top_logprobs=np.zeros((0, 4)),
            sampling_mask=[],
        )
    )
    scores = token_scores(tree_dense, row.pack(), top_ids=True, candidate_sets=True)
    assert scores.logprobs.shape == (0,) and scores.top_logprobs.shape == (0, 4)
    assert scores.candidate_logsumexp.shape == (0,)
    tree_dense.zero_grad()
    (scores.logprobs.sum() + scores.top_logprobs.sum() + scores.candidate_logsumexp.sum()).backward()
    assert all(p.grad is None or not p.grad.any() for p in tree_dense.parameters())


def test_requests_the_row_or_model_cannot_serve_name_the_fix(tree_dense, trees):
    row = trees.random_row(6, vocab=512)
    with pytest.raises(ValueError, match="router_aux_loss=False"):
        token_scores(tree_dense, row, router_aux_loss=True)
    with pytest.raises(ValueError, match="top_ids=False"):
        token_scores(tree_dense, row, top_ids=True)


def tiny_moe():
    from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer

    return build_model(TinyModelSpec(kind="moe"), build_tokenizer())


def test_moe_router_aux_loss_of_one_unshared_sample_equals_the_stock_forward():
    stock = tiny_moe()
    tree = copy.deepcopy(stock)
    enable_tree_attention(tree, backend="reference")
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2))
    row = TreeRow(0)
    row.add(
        PackSample(
            input_ids=ids.numpy(),
            trained_mask=[False] * 10 + [True] * 14,
            group_id=0,
            advantages=np.zeros(14),
            sampler_logprobs=np.zeros(14),
        )
    )
    packed = row.pack()
    scores = token_scores(tree, packed, router_aux_loss=True)
    direct = stock(input_ids=packed.input_ids[None], use_cache=False, output_router_logits=True)
    want_logprobs = direct.logits[0].log_softmax(-1)[packed.token_index, packed.targets]
    torch.testing.assert_close(scores.logprobs, want_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.aux_loss, direct.aux_loss, atol=1e-6, rtol=0)
    assert direct.aux_loss.requires_grad
    tree.zero_grad()
    stock.zero_grad()
    (scores.aux_loss + scores.logprobs.sum()).backward()
    (direct.aux_loss + want_logprobs.sum()).backward()
    pairs = zip(tree.named_parameters(), stock.named_parameters(), strict=True)
    assert_gradients_close({name: (_grad(p), _grad(q)) for (name, p), (_, q) in pairs}, rtol=1e-4)


# The fused LM head: logits exist one chunk at a time; it must equal the model's own logits path.


def _scores_and_gradients(model, packed, weights, *, autocast: bool):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        scores = token_scores(model, packed, temperature=0.7, top_ids=True, candidate_sets=True)
    outputs = (scores.logprobs, scores.top_logprobs, scores.candidate_logsumexp)
    top = torch.where(torch.isfinite(outputs[1]), outputs[1], 0.0)
    (weights[0] * outputs[0] + (weights[1] * top).sum(1) + weights[2] * outputs[2]).sum().backward()
    return outputs, {name: _grad(p) for name, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_the_fused_head_never_builds_full_logits_and_equals_the_models_own_logits(
    tiny_dense, trees, monkeypatch, autocast
):
    monkeypatch.setattr(token_logprobs_module, "_CHUNK_BYTES", 512 * 5)  # the fused head: 5 rows per chunk
    model = copy.deepcopy(tiny_dense)
    enable_tree_attention(model, "reference")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied: grads add up
    row = TreeRow(0)
    row.extend(with_sampler_data(trees.seeded_samples(3, vocab=512), seed=4))
    packed = row.pack()
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=generator) for s in ((packed.num_loss_terms,), packed.sampler_top_ids.shape,
                                                            (packed.num_loss_terms,))]  # fmt: skip
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _, args, out: seen.append(out.shape))
    fused, fused_grads = _scores_and_gradients(model, packed, weights, autocast=autocast)
    hook.remove()
    assert seen == [torch.Size([1, 0, 512])], "the head is handed no positions: no (M, V) logits"
    monkeypatch.setattr(token_logprobs_module, "_fusable_head", lambda model: None)
    plain, plain_grads = _scores_and_gradients(model, packed, weights, autocast=autocast)
    atol, rtol = (1e-6, 1e-2) if autocast else (2e-5, 1e-4)  # bf16 gradient matmuls round differently
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    assert_gradients_close({name: (fused_grads[name], plain_grads[name]) for name in fused_grads}, rtol=rtol)


def test_heads_with_logit_transforms_or_bias_use_the_models_own_logits(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    assert token_logprobs_module._fusable_head(model) is model.get_output_embeddings()
    model.config.final_logit_softcapping = 30.0  # Gemma-style: logits change after the head
    assert token_logprobs_module._fusable_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    assert token_logprobs_module._fusable_head(model) is None
