"""`agrpo_packing.testing`: the strategy's coverage and the packed-equals-alone assertion, exercised
with a tiny two-layer attention model whose packed forward gathers K/V along `kv_index`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from agrpo_packing import PackedRow, TreeRow
from agrpo_packing.testing import (
    SEQUENCE_KINDS,
    GroupShape,
    assert_packed_logprobs_match,
    grpo_groups,
    random_grpo_groups,
)

VOCAB = 5


class TinyLM(torch.nn.Module):
    """Embeddings + learned positions, two single-head causal attention layers, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8, dtype=torch.float64)
        self.position = torch.nn.Embedding(64, 8, dtype=torch.float64)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(8, 24, dtype=torch.float64) for _ in range(2))
        self.head = torch.nn.Linear(8, VOCAB, dtype=torch.float64)

    def _attend(self, q, k, v):
        """Causal attention aligned bottom-right: query j of n sees keys [0, len(k) - n + j]."""
        n, m = q.shape[0], k.shape[0]
        visible = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
        scores = (q @ k.T / 8**0.5).masked_fill(~visible, float("-inf"))
        return scores.softmax(-1) @ v

    def sequence_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.position(torch.arange(input_ids.shape[0]))
        for layer in self.qkv:
            h = h + self._attend(*layer(h).split(8, dim=-1))
        logprobs = self.head(h).log_softmax(-1)[:-1]
        return logprobs.gather(-1, input_ids[1:, None])[:, 0]

    def row_logprobs(self, row: PackedRow, *, ignore_ancestors: bool = False) -> torch.Tensor:
        h = self.embed(row.input_ids) + self.position(row.position_ids)
        q_off, kv_off = row.q_offsets.tolist(), row.kv_offsets.tolist()
        for layer in self.qkv:
            q, k, v = layer(h).split(8, dim=-1)
            out = []
            for s in range(row.num_segments):
                path = row.kv_index[kv_off[s] : kv_off[s + 1]]
                if ignore_ancestors:
                    path = path[path >= q_off[s]]
                out.append(self._attend(q[q_off[s] : q_off[s + 1]], k[path], v[path]))
            h = h + torch.cat(out) if out else h
        logprobs = self.head(h[row.token_index]).log_softmax(-1)
        return logprobs.gather(-1, row.targets[:, None])[:, 0]


MODEL = TinyLM()


@settings(max_examples=40, deadline=None)
@given(grpo_groups(vocab_size=VOCAB, sampler_data=False))
def test_packed_logprobs_and_gradients_equal_forwarding_each_sample_alone(samples):
    row = TreeRow(0)
    row.extend(samples)
    packed, reference = assert_packed_logprobs_match(
        row.pack(), MODEL.row_logprobs, MODEL.sequence_logprobs, atol=1e-10, rtol=1e-10
    )
    if packed.numel():
        grads = torch.autograd.grad(packed.sum(), list(MODEL.parameters()), allow_unused=True)
        expected = torch.autograd.grad(reference.sum(), list(MODEL.parameters()), allow_unused=True)
        for got, want in zip(grads, expected, strict=True):
            if want is not None:
                torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)


def test_the_assertion_catches_a_forward_that_ignores_shared_ancestors():
    samples = random_grpo_groups(
        GroupShape(
            num_prompts=1,
            rollouts_per_prompt=3,
            prompt_tokens=(6, 6),
            completion_tokens=(4, 6),
            vocab_size=VOCAB,
        )
    )
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    assert packed.num_segments > 1
    with pytest.raises(AssertionError, match="differ from forwarding each sample alone"):
        assert_packed_logprobs_match(
            packed, lambda r: MODEL.row_logprobs(r, ignore_ancestors=True), MODEL.sequence_logprobs
        )
    with pytest.raises(AssertionError, match="expected"):
        assert_packed_logprobs_match(packed, lambda r: torch.zeros(1), MODEL.sequence_logprobs)


@settings(max_examples=60, deadline=None)
@given(grpo_groups())
def test_the_strategy_draws_valid_samples_with_sampler_data_on_all_or_none(samples):
    assert samples
    assert len({s.sampler_top_ids is None for s in samples}) == 1
    assert len({s.sampling_mask is None for s in samples}) == 1
    for s in samples:
        assert s.input_ids.min() >= 0 and s.input_ids.max() < 3


def test_the_strategy_covers_every_kind_of_sample():
    assert set(SEQUENCE_KINDS) == {
        "completion",
        "multi_turn",
        "fork",
        "duplicate",
        "single_token",
        "untrained",
    }


def test_random_groups_have_the_requested_shape_and_are_reproducible():
    shape = GroupShape(num_prompts=5, rollouts_per_prompt=4, multi_turn_frac=1.0, fork_frac=1.0)
    samples = random_grpo_groups(shape, seed=7)
    again = random_grpo_groups(shape, seed=7)
    assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(samples, again, strict=True))
    assert sorted({s.group_id for s in samples}) == list(range(5))
    assert len(samples) > 5 * 4  # forks add samples
    for s in samples:
        assert np.flatnonzero(s.trained_mask)[0] >= 512 and s.num_trained >= 1


def test_random_groups_carry_sampler_top_k_when_asked():
    samples = random_grpo_groups(GroupShape(num_prompts=1, rollouts_per_prompt=2, sampler_top_k=4), seed=1)
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    assert packed.sampler_top_ids.shape == (packed.num_loss_terms, 4)
