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
