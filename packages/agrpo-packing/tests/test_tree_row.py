"""`TreeRow`: admission, totals and the packed layout, as properties over random GRPO groups."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agrpo_packing import PackingError, PackSample, RowFullError, TreeRow, token_path
from agrpo_packing.testing import GroupShape, TokenTrieRow, assert_row_layout, grpo_groups, random_grpo_groups

PROPERTY = settings(max_examples=200, deadline=None)
DEEP = grpo_groups(max_groups=2, max_rollouts=8, max_prompt_tokens=16, max_completion_tokens=12, vocab_size=2)


def _sample(ids, trained, group_id=0, routes=None) -> PackSample:
    mask = np.zeros(len(ids), dtype=bool)
    mask[list(trained)] = True
    n = int(mask.sum())
    return PackSample(
        input_ids=np.array(ids),
        trained_mask=mask,
        group_id=group_id,
        advantages=np.arange(n, dtype=np.float32),
        sampler_logprobs=-np.ones(n, dtype=np.float32),
        routed_experts=routes,
    )


def _routes(experts: list[list[int]]) -> np.ndarray:
    """(L, 2 layers, top_k 2) routes: token i goes to experts[i] in layer 1; layer 0 is dense (zeros)."""
    routes = np.zeros((len(experts), 2, 2), dtype=np.int16)
    routes[:, 1] = experts
    return routes


def _reference_nodes(samples) -> int:
    reference = TokenTrieRow()
    for s in samples:
        reference.add(s)
    return reference.num_nodes


@PROPERTY
@given(st.one_of(grpo_groups(), DEEP))
def test_packed_row_is_a_valid_layout_of_its_samples(samples):
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    assert_row_layout(packed, samples)
    assert packed.num_tokens == row.num_tokens == _reference_nodes(samples)
    assert packed.num_loss_terms == row.num_loss_terms
    assert row.cost == int((packed.position_ids + 1).sum())


@PROPERTY
@given(grpo_groups(), st.randoms(use_true_random=False))
def test_unique_tokens_do_not_depend_on_the_order_of_add(samples, random):
    shuffled = list(samples)
    random.shuffle(shuffled)
    a, b = TreeRow(0), TreeRow(0)
    a.extend(samples)
    b.extend(shuffled)
    assert a.num_tokens == b.num_tokens and a.cost == b.cost
    assert_row_layout(b.pack(), shuffled)


@PROPERTY
@given(st.one_of(grpo_groups(), DEEP), st.integers(1, 40))
def test_fits_is_exact_and_budgets_are_never_exceeded(samples, budget):
    row, held = TreeRow(budget), []
    for sample in samples:
        nodes = _reference_nodes([*held, sample])
        terms = row.num_loss_terms + int(sample.trained_mask.sum())
        assert row.fits(sample) == (nodes <= budget and terms <= budget)
        if row.fits(sample):
            row.add(sample)
            held.append(sample)
        else:
            with pytest.raises(RowFullError, match="check fits"):
                row.add(sample)
        assert row.num_tokens <= budget and row.num_loss_terms <= budget
    assert_row_layout(row.pack(), held)


@PROPERTY
@given(grpo_groups())
def test_plain_mode_forwards_every_sample_as_its_own_segment(samples):
    row = TreeRow(0, share_prefixes=False)
    row.extend(samples)
    packed = row.pack()
    assert_row_layout(packed, samples, shared=False)
    with_nodes = [s for s in samples if s.trained_mask.any()]
    assert packed.is_plain and packed.num_segments == len(with_nodes)
    assert np.array_equal(packed.kv_index.numpy(), np.arange(packed.num_tokens))
    assert packed.num_tokens == sum(int(np.flatnonzero(s.trained_mask)[-1]) for s in with_nodes)


def test_tree_mode_with_nothing_shared_is_plain_varlen():
    samples = [_sample([1, 2, 3], [1, 2]), _sample([4, 5], [1]), _sample([6, 7, 8, 9], [3])]
    tree, plain = TreeRow(0), TreeRow(0, share_prefixes=False)
    tree.extend(samples)
    plain.extend(samples)
    packed = tree.pack()
    assert packed.is_plain and packed.num_tokens == plain.pack().num_tokens == 2 + 1 + 3
    assert packed.q_offsets.tolist() == [0, 2, 3, 6]  # cu_seqlens of the varlen segments


def test_forks_happen_one_token_early_so_each_node_predicts_one_token():
    a, b = _sample([1, 2, 3, 4], [3]), _sample([1, 2, 3, 5], [3])
    row = TreeRow(0)
    row.extend([a, b])
    packed = row.pack()
    # (1,2) (2,3) are shared; token 3 is forwarded twice: once predicting 4, once predicting 5.
    assert packed.input_ids.tolist() == [1, 2, 3, 3]
    assert packed.position_ids.tolist() == [0, 1, 2, 2]
    assert packed.q_offsets.tolist() == [0, 2, 3, 4] and packed.segment_parent.tolist() == [-1, 0, 0]
    assert packed.kv_index.tolist() == [0, 1, 0, 1, 2, 0, 1, 3]
    assert packed.token_index.tolist() == [2, 3] and packed.targets.tolist() == [4, 5]


def test_tokens_after_the_last_trained_token_are_not_forwarded():
    row = TreeRow(0)
    row.add(_sample([7, 8, 9, 10, 11], [2]))
    packed = row.pack()
    assert packed.input_ids.tolist() == [7, 8] and packed.token_index.tolist() == [1]
    assert packed.num_raw_tokens == 5


def test_a_sample_extending_another_continues_its_segment():
    row = TreeRow(0)
    row.extend([_sample([1, 2, 3], [2]), _sample([1, 2, 3, 4, 5], [2, 4])])
    packed = row.pack()
    assert packed.num_segments == 1 and packed.input_ids.tolist() == [1, 2, 3, 4]
    assert packed.token_index.tolist() == [1, 1, 3]


def test_grpo_group_shares_its_prompt_once():
    samples = random_grpo_groups(GroupShape(num_prompts=1, multi_turn_frac=0.0), seed=3)
    row = TreeRow(0)
    row.extend(samples)
    prompt = min(int(np.flatnonzero(s.trained_mask)[0]) for s in samples)
    forwarded = sum(int(np.flatnonzero(s.trained_mask)[-1]) for s in samples)
    assert row.num_tokens >= forwarded - (len(samples) - 1) * prompt
    assert row.packing_ratio > 1.0
    assert_row_layout(row.pack(), samples)


def test_empty_row_and_untrained_samples_pack_to_empty_tensors():
    row = TreeRow(8)
    assert row.pack().num_tokens == 0
    row.add(_sample([5], []))
    packed = row.pack()
    assert packed.num_tokens == 0 and packed.num_segments == 0 and packed.num_samples == 1
    assert packed.q_offsets.tolist() == [0] and packed.kv_offsets.tolist() == [0]


def test_large_token_ids_sort_and_share_correctly():
    big = 2**40
    samples = [_sample([big, big + 1, 5, 6], [3]), _sample([big, big + 1, 5, 7], [3]), _sample([1, big], [1])]
    row = TreeRow(0)
    row.extend(samples)
    assert row.num_tokens == _reference_nodes(samples) == 5
    assert_row_layout(row.pack(), samples)


def test_wrong_arguments_name_the_fix():
    with pytest.raises(TypeError, match="token_budget must be an int"):
        TreeRow(None)
    with pytest.raises(TypeError, match="PackSample"):
        TreeRow(0).add({"input_ids": [1, 2]})


@PROPERTY
@given(st.one_of(grpo_groups(routes=True), grpo_groups(max_rollouts=8, vocab_size=2, routes=True)))
def test_routes_follow_tokens_into_tree_and_plain_rows(samples):
    for share in (True, False):
        row = TreeRow(0, share_prefixes=share)
        row.extend(samples)
        packed = row.pack()
        assert_row_layout(packed, samples, shared=share)  # checks routes token by token (first route wins)
        if not share:
            assert packed.route_conflicts == 0, "plain rows share no position"


def test_a_shared_prompt_keeps_the_first_samples_route_and_counts_disagreements():
    prompt = [[0, 1], [2, 3], [1, 3]]
    first = _sample([7, 8, 9, 4, 5], [3, 4], routes=_routes([*prompt, [0, 2], [1, 1]]))
    same_set = _sample([7, 8, 9, 6, 5], [3, 4], routes=_routes([[1, 0], [3, 2], [3, 1], [2, 2], [0, 0]]))
    other = _sample([7, 8, 9, 4, 6], [4], routes=_routes([[0, 1], [2, 0], [3, 0], [3, 3], [0, 0]]))
    row = TreeRow(0)
    row.extend([first, same_set, other])
    packed = row.pack()
    assert_row_layout(packed, [first, same_set, other])
    # Nodes (token -> next): 7 -> 8 and 8 -> 9 shared by all three, 9 -> 4 by first and other; the rest own.
    routes = {int(p): packed.routed_experts[p, 1].tolist() for p in range(packed.num_tokens)}
    assert routes[0] == [0, 1] and routes[1] == [2, 3], "the first sample's route, not a later one's"
    assert packed.route_conflicts == 2, "other disagrees at depths 1 and 2 (same experts reordered agree)"
    assert (packed.routed_experts[:, 0] == 0).all(), "dense layers pass through as the server sent them"


def test_unrouted_samples_leave_minus_one_unless_a_routed_sample_shares_the_token():
    routed = _sample([1, 2, 3, 4], [2, 3], routes=_routes([[0, 1], [1, 2], [2, 3], [3, 0]]))
    plain = _sample([1, 2, 5, 6, 7], [3, 4])
    gap = _routes([[0, 1], [1, 2], [2, 3], [3, 0]])
    gap[1] = -1  # a token this sample has no route for (e.g. the last sampled token of a turn)
    partial = _sample([1, 2, 3, 4], [3], routes=gap)
    row = TreeRow(0)
    row.extend([plain, partial, routed])
    packed = row.pack()
    assert_row_layout(packed, [plain, partial, routed])
    plain_path, routed_path = (token_path(packed, int(packed.token_index[t])) for t in (1, -1))
    assert packed.routed_experts[plain_path[0], 1].tolist() == [0, 1], (
        "node 1 -> 2 is shared with routed samples"
    )
    assert (packed.routed_experts[plain_path[1:]] == -1).all(), "2 -> 5 and on: only the unrouted sample's"
    assert packed.routed_experts[routed_path[1], 1].tolist() == [1, 2], "the gap is filled by the next route"
    assert packed.route_conflicts == 0
    row = TreeRow(0)
    row.extend([plain, _sample([1, 2, 3], [2])])
    assert row.pack().routed_experts is None, "no sample carries routes: no tensor"


def test_routes_of_different_models_in_one_row_are_refused():
    row = TreeRow(0)
    row.extend(
        [
            _sample([1, 2], [1], routes=np.zeros((2, 2, 2), int)),
            _sample([3, 4], [1], routes=np.zeros((2, 3, 2), int)),
        ]
    )
    with pytest.raises(PackingError, match=r"different \(num_layers, top_k\): \[\(2, 2\), \(3, 2\)\]"):
        row.pack()


def test_benchmark_groups_with_routes_share_them_without_conflict_and_keep_their_tokens():
    shape = GroupShape(
        num_prompts=3, rollouts_per_prompt=4, prompt_tokens=(20, 40), completion_tokens=(8, 30)
    )
    plain = random_grpo_groups(shape, seed=4)
    routed = random_grpo_groups(dataclasses.replace(shape, routed_experts=(4, 2, 16)), seed=4)
    assert [s.input_ids.tolist() for s in plain] == [s.input_ids.tolist() for s in routed], "same token data"
    row = TreeRow(0)
    row.extend(routed)
    packed = row.pack()
    assert_row_layout(packed, routed)
    assert packed.route_conflicts == 0 and packed.routed_experts.shape == (packed.num_tokens, 4, 2)
    assert (packed.routed_experts >= 0).all() and (packed.routed_experts < 16).all()
