"""`TreeLayout`: the depth-first interval relation must equal the literal path contract of PackedRow."""

from __future__ import annotations

import pytest
import torch

from agrpo_attention._tree_layout import build_tree_layout


@pytest.mark.parametrize("seed", range(5))
def test_subtree_interval_equals_path_visibility(trees, seed):
    row = trees.random_row(seed, vocab=3, prompts=3)
    layout = build_tree_layout(row, "cpu")
    i = torch.arange(row.num_tokens)
    interval = (i[None, :] <= i[:, None]) & (i[:, None] < layout.subtree_end[None, :])
    expected = trees.visibility_from_paths(row)
    assert torch.equal(interval, expected)
    assert layout.score_pairs == int(expected.sum())
    assert layout.max_q == int(torch.diff(row.q_offsets).max())
    assert not layout.is_flat


def test_plain_packing_makes_a_flat_layout(trees):
    row = trees.random_row(3, share=False)
    layout = build_tree_layout(row, "cpu")
    assert layout.is_flat
    assert torch.equal(layout.kv_index, torch.arange(row.num_tokens))
    lengths = torch.diff(row.q_offsets)
    assert layout.score_pairs == int((lengths * (lengths + 1) // 2).sum())
