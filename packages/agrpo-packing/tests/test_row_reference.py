"""`token_path`, `unpack` and `reference_logprobs`: per-sample views rebuilt from a packed row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from agrpo_packing import TreeRow, reference_logprobs, token_path, unpack
from agrpo_packing.testing import grpo_groups


@settings(max_examples=80, deadline=None)
@given(grpo_groups())
def test_unpack_rebuilds_each_sample_through_its_last_trained_token(samples):
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    for sample, view in zip(samples, unpack(packed), strict=True):
        trained = np.flatnonzero(sample.trained_mask)
        if not trained.size:
            assert view.input_ids.numel() == 0 and view.loss_terms.numel() == 0
            continue
        assert view.input_ids.tolist() == sample.input_ids[: trained[-1] + 1].tolist()
        assert view.loss_positions.tolist() == (trained - 1).tolist()
        assert packed.targets[view.loss_terms].tolist() == sample.input_ids[trained].tolist()


def test_token_path_is_the_root_to_position_chain():
    from agrpo_packing import PackSample

    def sample(ids):
        return PackSample(
            input_ids=np.array(ids),
            trained_mask=np.arange(len(ids)) == len(ids) - 1,
            group_id=0,
            advantages=np.zeros(1),
            sampler_logprobs=np.zeros(1),
        )

    row = TreeRow(0)
    row.extend([sample([1, 2, 3, 4]), sample([1, 2, 3, 5, 6])])
    packed = row.pack()
    last = packed.num_tokens - 1
    assert packed.input_ids[token_path(packed, last)].tolist() == [1, 2, 3, 5]
    with pytest.raises(IndexError, match="outside"):
        token_path(packed, packed.num_tokens)


def test_reference_logprobs_align_with_loss_terms():
    from agrpo_packing.testing import GroupShape, random_grpo_groups

    samples = random_grpo_groups(GroupShape(num_prompts=2, rollouts_per_prompt=3, prompt_tokens=(4, 8)))
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()

    def next_token_ids(ids: torch.Tensor) -> torch.Tensor:  # "log-prob" = the next token's id
        return ids[1:].double()

    assert torch.equal(reference_logprobs(packed, next_token_ids), packed.targets.double())


@settings(max_examples=80, deadline=None)
@given(grpo_groups(routes=True))
def test_unpack_gives_each_sample_the_rows_route_at_each_of_its_tokens(samples):
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    for sample, view in zip(samples, unpack(packed), strict=True):
        if packed.routed_experts is None or not view.input_ids.numel():
            assert view.routed_experts is None or view.input_ids.numel() == 0
            continue
        assert view.routed_experts.shape == (view.input_ids.numel(), *packed.routed_experts.shape[1:])
        assert (view.routed_experts[-1] == -1).all(), "the last trained token is never forwarded"
        if packed.route_conflicts == 0 and sample.routed_experts is not None:
            own = torch.from_numpy(sample.routed_experts[: view.input_ids.numel() - 1])
            routed = (own != -1).any(dim=(1, 2))
            assert torch.equal(view.routed_experts[:-1][routed], own[routed])
