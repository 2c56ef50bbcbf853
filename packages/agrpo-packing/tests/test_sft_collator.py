"""`SFTCollator`: the transformers/TRL SFT convention (input_ids, labels with -100) to one prefix-tree row."""

from __future__ import annotations

import pytest

from agrpo_packing import PackingError, SFTCollator
from agrpo_packing.testing import assert_row_layout

SYSTEM = list(range(1, 41))  # 40 shared tokens


def _example(tail: list[int], trained_from: int) -> dict[str, list[int]]:
    ids = SYSTEM + tail
    labels = [-100] * (len(SYSTEM) + trained_from) + tail[trained_from:]
    return {"input_ids": ids, "labels": labels}


def test_examples_sharing_a_system_prompt_forward_it_once():
    features = [_example([50 + i, 60 + i, 70 + i, 80 + i], 1) for i in range(4)]
    batch = SFTCollator()(features)
    row = batch["packed_row"]
    assert row.num_raw_tokens == 4 * 44 and row.num_tokens == 40 + 4 * 4 - 1  # forks one token early
    assert row.num_loss_terms == 4 * 3 and row.num_samples == 4
    assert batch["input_ids"] is row.input_ids
    # every loss term's target is the labelled token, predicted by the position before it
    expected = [t for f in features for t in f["labels"] if t != -100]
    assert row.targets.tolist() == expected
    assert row.advantages.tolist() == [1.0] * 12 and row.sampler_logprobs.tolist() == [0.0] * 12


def test_plain_mode_forwards_each_example_whole():
    features = [_example([50 + i, 60 + i], 0) for i in range(3)]
    row = SFTCollator(share_prefixes=False)(features)["packed_row"]
    assert row.is_plain and row.num_tokens == row.num_raw_tokens - 3  # each last token predicts nothing
    samples_row = SFTCollator()(features)["packed_row"]
    assert samples_row.num_tokens < row.num_tokens


def test_the_first_token_is_never_a_loss_term():
    """A label on position 0 has no predecessor; transformers' shifted loss drops it too."""
    row = SFTCollator()([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}])["packed_row"]
    assert row.targets.tolist() == [6, 7]


def test_layout_contract_holds():
    from agrpo_packing._sft_collator import _sample

    features = [_example([50, 60 + i % 2, 70 + i], 1) for i in range(5)]
    samples = [_sample(f, i, -100) for i, f in enumerate(features)]
    assert_row_layout(SFTCollator()(features)["packed_row"], samples)


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        ({"input_ids": [1, 2, 3]}, "needs `input_ids` and `labels`"),
        ({"input_ids": [1, 2, 3], "labels": [-100, 2]}, "differ in shape"),
        ({"input_ids": [1, 2, 3], "labels": [-100, 2, 4]}, r"labels\[2\]=4 differs from input_ids\[2\]=3"),
    ],
)
def test_malformed_examples_are_refused_naming_the_fix(feature, message):
    with pytest.raises(PackingError, match=message):
        SFTCollator()([feature])
