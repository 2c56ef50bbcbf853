"""`PackSample`: validation messages name the fix."""

from __future__ import annotations

import numpy as np
import pytest

from agrpo_packing import PackingError, PackSample


def _kwargs(**over):
    base = {
        "input_ids": [1, 2, 3],
        "trained_mask": [False, True, True],
        "group_id": 0,
        "advantages": [1.0, 1.0],
        "sampler_logprobs": [-0.5, -0.5],
    }
    return base | over


def test_valid_sample_converts_dtypes():
    sample = PackSample(**_kwargs())
    assert sample.input_ids.dtype == np.int64 and sample.advantages.dtype == np.float32
    assert (sample.num_tokens, sample.num_trained) == (3, 2)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"trained_mask": [True, True, False]}, "first token"),
        ({"advantages": [1.0, 1.0, 1.0]}, "aligned to trained tokens only"),
        ({"trained_mask": [False, True]}, "same length"),
        ({"sampler_top_ids": [[1], [2]]}, "come together"),
        ({"sampling_mask": [[1]]}, "sets for 2 trained tokens"),
    ],
)
def test_invalid_samples_are_refused(over, message):
    with pytest.raises(ValueError, match=message):
        PackSample(**_kwargs(**over))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"input_ids": [1, -2, 3]}, r"input_ids\[1\] is -2: token ids are >= 0"),
        ({"input_ids": [1, 5.7, 3]}, r"input_ids\[1\] is 5.7: token ids are integers"),
        ({"input_ids": [1.0, 2.0, 3.0]}, "token ids are integers"),
        ({"input_ids": np.array([1, 2, 2**63], dtype=np.uint64)}, r"input_ids\[2\] is 9223372036854775808"),
        ({"input_ids": ["a", "b", "c"]}, "token ids are integers"),
        ({"advantages": [1.0, float("nan")]}, r"advantages\[1\] is nan"),
        ({"advantages": [float("inf"), 1.0]}, r"advantages\[0\] is inf"),
        ({"advantages": [1e308, 1.0]}, r"advantages\[0\] is inf as float32"),
        ({"sampler_logprobs": [-0.5, float("-inf")]}, r"sampler_logprobs\[1\] is -inf"),
        (
            {"input_ids": [], "trained_mask": [], "advantages": [], "sampler_logprobs": []},
            "empty sample",
        ),
    ],
)
def test_bad_ids_non_finite_values_and_empty_samples_are_refused(over, message):
    with pytest.raises(PackingError, match=message):
        PackSample(**_kwargs(**over))


def test_integer_id_arrays_of_any_width_and_untrained_samples_are_accepted():
    sample = PackSample(**_kwargs(input_ids=np.array([1, 2, 3], dtype=np.uint16)))
    assert sample.input_ids.dtype == np.int64 and sample.input_ids.tolist() == [1, 2, 3]
    lone = PackSample(input_ids=[7], trained_mask=[False], group_id=0, advantages=[], sampler_logprobs=[])
    assert (lone.num_tokens, lone.num_trained) == (1, 0)


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        (np.zeros((2, 4, 2), np.int16), r"shape \(2, 4, 2\); expected \(3, num_layers, top_k\)"),
        (np.zeros((3, 4)), r"expected \(3, num_layers, top_k\)"),
        (np.zeros((3, 4, 2), np.float32), "dtype float32; expert ids are integers"),
        (np.full((3, 4, 2), -2), r"routed_experts\[0, 0, 0\] is -2"),
        (np.full((3, 4, 2), 40000, np.uint16), r"is 40000: expert ids are in \[0, 32767\]"),
    ],
)
def test_routes_of_the_wrong_shape_or_values_are_refused(routes, message):
    with pytest.raises(PackingError, match=message):
        PackSample(**_kwargs(routed_experts=routes))


def test_routes_are_kept_per_token_as_int16():
    routes = np.arange(3 * 4 * 2, dtype=np.uint8).reshape(3, 4, 2)
    routes_with_gap = routes.astype(np.int64)
    routes_with_gap[2] = -1  # the last sampled token: no route
    for given in (routes, routes_with_gap):
        sample = PackSample(**_kwargs(routed_experts=given))
        assert sample.routed_experts.dtype == np.int16 and np.array_equal(sample.routed_experts, given)
    assert PackSample(**_kwargs()).routed_experts is None
