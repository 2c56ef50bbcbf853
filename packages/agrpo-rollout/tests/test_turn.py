import numpy as np
import pytest

from agrpo_rollout import TopLogprobs, TurnRecord


def test_top_logprobs_reads_like_a_list_of_dicts():
    top = TopLogprobs.from_dicts([{5: -0.1, 7: -2.0, 9: -3.0}, {1: -0.5}], k=2)
    assert top.ids.tolist() == [[5, 7], [1, -1]]
    assert np.isneginf(top.logprobs[1, 1])
    assert len(top) == 2
    assert top[0] == pytest.approx({5: -0.1, 7: -2.0})
    assert list(top)[1] == {1: -0.5}


def test_turn_record_converts_and_checks_alignment():
    turn = TurnRecord(
        prompt_ids=[1, 2],
        output_ids=[3, 4],
        output_log_probs=[-0.1, -0.2],
        output_sampler_logprobs=[{3: -0.1}, {4: -0.2, 8: -1.0}],
        finish_reason="stop",
    )
    assert turn.output_ids.dtype == np.int64 and turn.output_log_probs.dtype == np.float32
    assert turn.trained_mask.tolist() == [True, True]
    assert turn.stopped and turn.output_sampler_logprobs.ids.shape == (2, 2)
    with pytest.raises(ValueError, match="one per output token"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_log_probs=[-0.1])


def test_trained_tokens_need_log_probs_but_context_tokens_do_not():
    with pytest.raises(ValueError, match="output_log_probs is None"):
        TurnRecord(prompt_ids=[1], output_ids=[3])
    turn = TurnRecord(prompt_ids=[1], output_ids=[3], output_mask=[0])
    assert turn.trained_mask.tolist() == [False]


def test_routes_cover_prompt_and_output_tokens():
    routes = np.zeros((4, 3, 2), dtype=np.uint8)
    turn = TurnRecord(
        prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2], routed_experts=routes
    )
    assert turn.routed_experts.dtype == np.int16 and turn.routed_experts.shape == (4, 3, 2)
    with pytest.raises(
        ValueError, match=r"routed_experts has shape \(2, 3, 2\); expected \(4, layers, top_k\)"
    ):
        TurnRecord(
            prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2], routed_experts=routes[2:]
        )
