"""`PackSample`: validation messages name the fix."""

from __future__ import annotations

import numpy as np
import pytest

from agrpo_packing import PackSample


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
