"""`DeltaNetPlan`: halo windows are each segment's path predecessors; levels cover the tree parent-first."""

from __future__ import annotations

import pytest
import torch

from agrpo_attention._deltanet_plan import build_deltanet_plan


@pytest.mark.parametrize("taps", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_halo_holds_the_path_predecessors_of_each_segment(trees, seed, taps):
    row = trees.random_row(seed, vocab=3)
    plan = build_deltanet_plan(row, taps, "cpu")
    n, halo = row.num_tokens, taps - 1
    ext = plan.halo_index.tolist()
    for s in range(row.num_segments):
        q0, q1 = int(row.q_offsets[s]), int(row.q_offsets[s + 1])
        path = row.kv_index[int(row.kv_offsets[s]) : int(row.kv_offsets[s + 1])].tolist()
        before = path[: len(path) - (q1 - q0)]
        want = [n] * max(0, halo - len(before)) + before[max(0, len(before) - halo) :]
        block = int(plan.conv_out_index[q0])
        assert ext[block : block + halo] == want
        assert ext[block + halo : block + halo + q1 - q0] == list(range(q0, q1))
    assert torch.equal(plan.halo_index[plan.conv_out_index + halo], torch.arange(n))


def test_levels_run_parents_first_and_cover_every_token_once(trees):
    row = trees.random_row(11, vocab=3, prompts=3)
    plan = build_deltanet_plan(row, 4, "cpu")
    order = torch.cat([level.token_index for level in plan.levels])
    assert torch.equal(order.sort().values, torch.arange(row.num_tokens))
    assert torch.equal(order[plan.inverse_order], torch.arange(row.num_tokens))
    assert plan.levels[0].parent_slot is None
    segment_of = torch.repeat_interleave(torch.arange(row.num_segments), torch.diff(row.q_offsets))
    for previous, level in zip(plan.levels, plan.levels[1:], strict=False):
        starts = level.token_index[level.cu_seqlens[:-1]]
        parents = row.segment_parent[segment_of[starts]]
        parent_starts = previous.token_index[previous.cu_seqlens[:-1]]
        assert torch.equal(segment_of[parent_starts[level.parent_slot]], parents)
