"""The public surface of agrpo_packing is a reviewed decision (style.md habit 14)."""

from __future__ import annotations

import agrpo_packing
import agrpo_packing.testing

EXPORTED = [
    "MicroBatch",
    "PackSample",
    "PackedRow",
    "PackingConfig",
    "PackingError",
    "Planner",
    "RowFullError",
    "SFTCollator",
    "TreeRow",
    "UnpackedSample",
    "reference_logprobs",
    "token_path",
    "unpack",
]

TESTING = [
    "GroupShape",
    "TokenTrieRow",
    "assert_packed_logprobs_match",
    "assert_row_layout",
    "grpo_groups",
    "random_grpo_groups",
]


def test_root_exports_are_frozen():
    assert agrpo_packing.__all__ == EXPORTED


def test_testing_exports_are_frozen():
    assert agrpo_packing.testing.__all__ == TESTING
    for name in TESTING:
        assert hasattr(agrpo_packing.testing, name)
