"""The fast decoder against the plain reference, on real server responses and recorded ones."""

import httpx
import numpy as np
import pytest

from agrpo_rollout import ResponseFormatError, decode_completion
from tools.bench.rollout_client.__main__ import confident, load_responses


def _same(raw: bytes, num_top: int = 8) -> None:
    fast = decode_completion(raw, [1, 2], num_top)
    plain = decode_completion(raw, [1, 2], num_top, reference=True)
    assert np.array_equal(fast.output_ids, plain.output_ids)
    assert np.array_equal(fast.output_log_probs, plain.output_log_probs)
    if num_top == 0:
        assert fast.output_sampler_logprobs is None and plain.output_sampler_logprobs is None
        return
    assert np.array_equal(fast.output_sampler_logprobs.ids, plain.output_sampler_logprobs.ids)
    assert np.array_equal(fast.output_sampler_logprobs.logprobs, plain.output_sampler_logprobs.logprobs)
    assert fast.finish_reason == plain.finish_reason


@pytest.mark.parametrize("variant", ["recorded", "confident"])
def test_fast_path_equals_reference_on_recorded_responses(variant):
    for raw in load_responses():
        _same(confident(raw) if variant == "confident" else raw)


def test_fast_path_equals_reference_on_live_responses(vllm_server):
    for temperature, num_top in [(1.0, 8), (0.05, 8), (1.0, 3), (0.7, 1), (1.0, 0)]:
        body = {
            "model": vllm_server.model_name,
            "prompt": [5, 6, 7, 8],
            "max_tokens": 40,
            "logprobs": num_top,
            "temperature": temperature,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        raw = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=60).content
        _same(raw, num_top)
        if num_top == 0:
            continue
        turn = decode_completion(raw, [5, 6, 7, 8], num_top)
        top = turn.output_sampler_logprobs
        assert top.ids.shape == (turn.num_output_tokens, num_top) and (top.ids >= 0).all()
        sampled_in_top = top.ids == turn.output_ids[:, None]
        assert np.allclose(
            top.logprobs[sampled_in_top], np.repeat(turn.output_log_probs, sampled_in_top.sum(1))
        )


def test_sampled_token_outside_the_top_k_is_dropped_and_inside_is_kept():
    raw = (
        b'{"choices":[{"token_ids":[9,3],"finish_reason":"stop","logprobs":{"token_logprobs":[-4.5,-0.25],'
        b'"top_logprobs":[{"token_id:9":-4.5,"token_id:1":-0.5,"token_id:2":-1.5},'
        b'{"token_id:3":-0.25,"token_id:4":-2.5e-05}]}}]}'
    )
    for reference in (False, True):
        turn = decode_completion(raw, [0], 2, reference=reference)
        assert turn.output_sampler_logprobs.ids.tolist() == [[1, 2], [3, 4]]
        assert turn.output_sampler_logprobs.logprobs[1, 1] == np.float32(-2.5e-05)
        assert turn.stopped and turn.output_log_probs.tolist() == [-4.5, -0.25]


def test_clamped_minus_inf_and_missing_fields():
    raw = (
        b'{"choices":[{"token_ids":[7],"finish_reason":"length","logprobs":{"token_logprobs":[-0.1],'
        b'"top_logprobs":[{"token_id:7":-0.1,"token_id:8":-9999.0}]}}]}'
    )
    assert np.isneginf(decode_completion(raw, [0], 2).output_sampler_logprobs.logprobs[0, 1])
    with pytest.raises(ResponseFormatError, match="return_token_ids"):
        decode_completion(b'{"choices":[{"text":"hi"}]}', [0], 2)
