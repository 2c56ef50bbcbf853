import numpy as np

from agrpo_packing import PackSample
from agrpo_rollout import RolloutSample, TopLogprobs, TurnRecord, build_sequences


def _turn(prompt, output, mask=None, k=2):
    n = len(output)
    top = TopLogprobs(ids=np.tile(np.arange(k), (n, 1)), logprobs=np.full((n, k), -1.0))
    return TurnRecord(
        prompt_ids=prompt,
        output_ids=output,
        output_log_probs=-np.arange(1, n + 1, dtype=np.float32) / 10,
        output_mask=mask,
        output_sampler_logprobs=top,
        finish_reason="stop",
    )


def test_clean_boundary_appends_to_one_sequence():
    first = _turn([1, 2, 3], [10, 11])
    second = _turn([1, 2, 3, 10, 11, 4, 5], [12])
    sequences, stats = build_sequences([first, second], "r")
    assert (stats.boundaries, stats.forks, stats.drift_tokens) == (1, 0, [0])
    (seq,) = sequences
    assert seq.input_ids.tolist() == [1, 2, 3, 10, 11, 4, 5, 12]
    assert seq.trained_mask.tolist() == [False, False, False, True, True, False, False, True]
    assert np.allclose(seq.sampler_logprobs, [-0.1, -0.2, -0.1])
    assert seq.sampler_top_ids.shape == (3, 2) and seq.rollout_id == "r"


def test_divergent_prompt_forks_and_shares_the_prefix():
    first = _turn([1, 2, 3], [10, 11, 12])
    rewritten = _turn([1, 2, 3, 12, 4], [13])  # the template dropped 10, 11 from the history
    sequences, stats = build_sequences([first, rewritten])
    assert (stats.forks, stats.drift_tokens) == (1, [3])
    assert [s.input_ids.tolist() for s in sequences] == [[1, 2, 3, 10, 11, 12], [1, 2, 3, 12, 4, 13]]
    assert [int(s.trained_mask.sum()) for s in sequences] == [3, 1]


def test_context_only_tokens_are_not_trained_and_empty_sequences_drop():
    scripted = _turn([1, 2], [7, 8, 9], mask=[1, 0, 0])
    sequences, _ = build_sequences([scripted])
    assert sequences[0].trained_mask.tolist() == [False, False, True, False, False]
    assert sequences[0].sampler_logprobs.tolist() == [np.float32(-0.1)]
    untrained = _turn([1, 2], [7], mask=[0])
    fork = _turn([5, 6], [9])
    sequences, stats = build_sequences([untrained, fork])
    assert stats.forks == 1 and len(sequences) == 1 and sequences[0].input_ids.tolist() == [5, 6, 9]


def test_missing_top_logprobs_or_masks_propagate_as_none():
    plain = TurnRecord(prompt_ids=[1], output_ids=[2], output_log_probs=[-0.5])
    masked = TurnRecord(
        prompt_ids=[1, 2, 3], output_ids=[4], output_log_probs=[-0.5], output_sampling_mask=[[4, 5]]
    )
    (seq,), _ = build_sequences([plain, masked])
    assert seq.sampler_top_ids is None and seq.sampling_mask is None
    (seq,), _ = build_sequences([masked])
    assert [m.tolist() for m in seq.sampling_mask] == [[4, 5]]


def test_samples_convert_losslessly_to_pack_samples():
    (seq,), _ = build_sequences([_turn([1, 2, 3], [10, 11]), _turn([1, 2, 3, 10, 11, 4], [12])])
    sample = RolloutSample.from_sequence(seq, advantage=0.5, group_id=3, policy_version=2)
    packed = PackSample(**sample.pack_fields())
    assert packed.num_trained == 3 and packed.group_id == 3
    assert np.array_equal(packed.input_ids, seq.input_ids) and np.all(packed.advantages == 0.5)
    assert np.array_equal(packed.sampler_top_ids, seq.sampler_top_ids)
    assert set(sample.pack_fields()) == {
        "input_ids", "trained_mask", "group_id", "advantages", "sampler_logprobs",
        "sampler_top_ids", "sampler_top_logprobs", "sampling_mask", "routed_experts",
    }  # fmt: skip


def _routed(turn: TurnRecord, start: int = 0, salt: int = 0) -> TurnRecord:
    """`turn` with the routes a server would return from `start` on: token t at any position goes to experts
    (t + salt, t + salt + 1) % 8 in its one MoE layer; the last output token has none."""
    tokens = np.concatenate([turn.prompt_ids, turn.output_ids])
    routes = np.stack([tokens + salt, tokens + salt + 1], axis=-1)[:, None, :] % 8
    routes[:start] = -1
    routes[-1] = -1
    turn.routed_experts = routes.astype(np.int16)
    return turn


def _expected(tokens, salt=0):
    return (
        np.stack([np.asarray(tokens) + salt, np.asarray(tokens) + salt + 1], axis=-1)[:, None, :] % 8
    ).tolist()


def test_routes_carry_through_turns_with_each_token_routed_once():
    first = _routed(_turn([1, 2, 3], [10, 11]))
    second = _routed(_turn([1, 2, 3, 10, 11, 4, 5], [12, 13]), start=4)  # skips what the first turn routed
    (seq,), stats = build_sequences([first, second])
    assert seq.routed_experts.shape == (9, 1, 2) and seq.routed_experts.dtype == np.int16
    assert seq.routed_experts[:-1].tolist() == _expected(seq.input_ids[:-1])
    assert (seq.routed_experts[-1] == -1).all() and stats.route_conflicts == 0
    assert seq.routed_experts[4:5].tolist() == _expected([11]), (
        "the first turn's last token: routed by the second"
    )


def test_a_later_turn_that_routes_held_tokens_differently_loses_and_is_counted():
    first = _routed(_turn([1, 2, 3], [10, 11]))
    second = _routed(_turn([1, 2, 3, 10, 11, 4], [12]), salt=3)  # re-sends everything, routed otherwise
    (seq,), stats = build_sequences([first, second])
    assert seq.routed_experts[:4].tolist() == _expected([1, 2, 3, 10]), "the first turn's routes win"
    assert seq.routed_experts[4:6].tolist() == _expected([11, 4], salt=3), "what only the later turn routed"
    assert stats.route_conflicts == 4


def test_a_fork_shares_the_held_routes_up_to_the_divergence_point():
    first = _routed(_turn([1, 2, 3], [10, 11, 12]))
    rewritten = _routed(_turn([1, 2, 3, 12, 4], [13]), salt=3)  # shares [1, 2, 3], routed otherwise
    sequences, stats = build_sequences([first, rewritten])
    assert stats.forks == 1 and stats.route_conflicts == 3
    fork = sequences[1].routed_experts
    assert fork[:3].tolist() == sequences[0].routed_experts[:3].tolist() == _expected([1, 2, 3])
    assert fork[3:5].tolist() == _expected([12, 4], salt=3) and (fork[5] == -1).all()


def test_a_turn_without_routes_leaves_its_sequence_without_routes():
    (seq,), _ = build_sequences([_routed(_turn([1, 2], [3])), _turn([1, 2, 3, 4], [5])])
    assert seq.routed_experts is None
    (seq,), _ = build_sequences([_turn([1, 2], [3]), _routed(_turn([1, 2, 3, 4], [5]))])
    assert seq.routed_experts is None


def test_routes_cross_to_pack_samples_and_one_route_per_shared_token_in_a_row():
    from agrpo_packing import TreeRow
    from agrpo_packing.testing import assert_row_layout

    samples = []
    for output, salt in (([10, 11], 0), ([10, 12], 0), ([14, 15], 5)):
        (seq,), _ = build_sequences([_routed(_turn([1, 2, 3], output), salt=salt)])
        sample = RolloutSample.from_sequence(seq, advantage=1.0, group_id=0)
        samples.append(PackSample(**sample.pack_fields()))
    assert samples[2].routed_experts[:-1].tolist() == _expected([1, 2, 3, 14], salt=5)
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    assert_row_layout(packed, samples)
    assert packed.routed_experts.shape == (packed.num_tokens, 1, 2)
    assert packed.route_conflicts == 2, (
        "the third sample routed the shared nodes 1 -> 2 and 2 -> 3 differently"
    )
