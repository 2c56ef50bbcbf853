"""`DeltaNetPlan`: halo windows and conv tables are each token's path predecessors; levels and segment tables
cover the tree parent-first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agrpo_attention._deltanet_plan import build_deltanet_plan, chunk_table


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


def test_chunk_table_lists_every_chunk_of_every_sequence_once():
    lengths = [1, 64, 65, 0, 130]
    offsets, table = chunk_table(np.array(lengths))
    assert [tuple(t) for t in table.tolist()] == [
        (s, c) for s, n in enumerate(lengths) for c in range(-(-n // 64))
    ]
    assert offsets.tolist() == [0, 1, 2, 4, 4, 7]


def test_segment_tables_list_parents_children_and_levels(trees):
    row = trees.random_row(11, vocab=3, prompts=3)
    tables = build_deltanet_plan(row, 4, "cpu").segments
    parents = row.segment_parent.tolist()
    assert tables.offsets.tolist() == row.q_offsets.tolist() and tables.parent.tolist() == parents
    for s in range(row.num_segments):
        listed = tables.children[tables.child_offsets[s] : tables.child_offsets[s + 1]].tolist()
        assert listed == [c for c, p in enumerate(parents) if p == s]
    bounds = tables.level_offsets_host.tolist()
    seen: set[int] = set()
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        level = tables.level_segments[begin:end].tolist()
        assert all(parents[s] < 0 or parents[s] in seen for s in level)  # parents in earlier levels
        seen |= set(level)
    assert sorted(seen) == list(range(row.num_segments))
    want = chunk_table(np.diff(row.q_offsets.numpy()))
    assert (
        tables.chunk_table.tolist() == want[1].tolist() and tables.chunk_offsets.tolist() == want[0].tolist()
    )


@pytest.mark.parametrize("taps", [2, 4])
def test_conv_tables_hold_path_predecessors_and_every_fork_successor(trees, taps):
    row = trees.random_row(3, vocab=3)
    plan = build_deltanet_plan(row, taps, "cpu")
    pred = plan.conv.predecessors.tolist()
    for s in range(row.num_segments):
        q0, q1 = int(row.q_offsets[s]), int(row.q_offsets[s + 1])
        path = row.kv_index[int(row.kv_offsets[s]) : int(row.kv_offsets[s + 1])].tolist()
        for t in range(q0, q1):
            at = len(path) - (q1 - t)  # t's place on its own path
            assert pred[t] == [path[at - j] if at - j >= 0 else -1 for j in range(1, taps)]
    forks = plan.conv.fork_tokens.tolist()
    offsets, successors = plan.conv.fork_offsets.tolist(), plan.conv.fork_successors.tolist()
    for x, s in enumerate(forks):
        want = {(s, 0)} | {
            (t, j) for t in range(row.num_tokens) for j in range(1, taps) if pred[t][j - 1] == s
        }
        assert {tuple(p) for p in successors[offsets[x] : offsets[x + 1]]} == want
    far = {
        pred[t][j - 1]
        for t in range(row.num_tokens)
        for j in range(1, taps)
        if pred[t][j - 1] not in (-1, t - j)
    }
    assert far == set(forks) and far  # exactly the tokens with a successor elsewhere; this row has forks
