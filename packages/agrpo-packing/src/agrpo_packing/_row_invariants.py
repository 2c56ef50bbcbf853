"""`assert_row_layout`: the documented invariants of a `PackedRow`, checked against its samples.

Owns the executable form of `PackedRow`'s contract (the properties SPEC F-PACK and issue 3 list):
segments tile the row in depth-first pre-order (so a subtree is contiguous); each segment's K/V path is its parent's path plus itself;
positions equal depth; segments are maximal (a segment has 0 or >= 2 child segments); every node
predicts exactly one token and siblings differ in (token, next token), so nothing is forwarded twice;
every trained token of every sample is exactly one loss term whose predicting position's path spells
the sample's preceding tokens; per-term data is the sample's, in order; each position's MoE route is the
first route a sample (in order of add) carries there, and the other samples' different routes are
`route_conflicts`. Python loops over tokens: for tests, not for training. Does not know how the row was built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._packed_row import PackedRow
from ._row_reference import token_path
from ._sample import PackSample


def _check_segments(row: PackedRow) -> tuple[list[int], list[int]]:
    q, parents = row.q_offsets.tolist(), row.segment_parent.tolist()
    assert q[0] == 0 and q[-1] == row.num_tokens, f"q_offsets {q[:4]}.. must tile [0, {row.num_tokens})"
    assert all(a < b for a, b in zip(q, q[1:], strict=False)), "every segment holds at least one token"
    assert all(-1 <= p < s for s, p in enumerate(parents)), "a parent segment precedes its children"
    for s in range(1, len(parents)):  # depth-first pre-order: a subtree's segments are contiguous
        chain, p = set(), s - 1
        while p >= 0:
            chain.add(p)
            p = parents[p]
        assert parents[s] == -1 or parents[s] in chain, f"segment {s} breaks the depth-first order"
    paths: list[list[int]] = []
    kv, kv_offsets = row.kv_index.tolist(), row.kv_offsets.tolist()
    depth = row.position_ids.tolist()
    for s, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + list(range(q[s], q[s + 1])))
        assert kv[kv_offsets[s] : kv_offsets[s + 1]] == paths[s], (
            f"segment {s}: kv_index is not its root path"
        )
        assert [depth[i] for i in paths[s]] == list(range(len(paths[s]))), f"segment {s}: positions != depth"
    assert kv_offsets[-1] == len(kv)
    return q, parents


def _next_tokens(row: PackedRow, q: list[int], parents: list[int], shared: bool) -> list[int]:
    """The one token each node predicts (-1 for a leaf nobody trains on, which must not exist)."""
    ids = row.input_ids.tolist()
    children: dict[int, list[int]] = {}
    for s, p in enumerate(parents):
        children.setdefault(p, []).append(s)
    nxt = ids[1:] + [-1] if ids else []
    for s in range(len(parents)):
        kids = children.get(s, [])
        assert len(kids) != 1, f"segment {s} has a single child segment: it should have continued"
        first = {ids[q[c]] for c in kids}
        assert len(first) <= 1, f"children of segment {s} start with different tokens {first}: keyed wrong"
        nxt[q[s + 1] - 1] = first.pop() if first else -1
    for m, (p, target) in enumerate(zip(row.token_index.tolist(), row.targets.tolist(), strict=True)):
        if nxt[p] == -1:
            nxt[p] = target
        assert nxt[p] == target, f"loss term {m}: position {p} predicts {nxt[p]} and {target}"
    assert -1 not in nxt, "a forwarded leaf predicts no loss term: it should not have been forwarded"
    for kids in children.values() if shared else ():
        keys = [(ids[q[c]], nxt[q[c]]) for c in kids]
        assert len(set(keys)) == len(keys), f"sibling segments repeat a (token, next token) node: {keys}"
    return nxt


def _check_sample(row: PackedRow, k: int, sample: PackSample) -> None:
    terms = np.flatnonzero(row.sample_index.numpy() == k)
    trained = np.flatnonzero(sample.trained_mask)
    assert terms.shape == trained.shape, (
        f"sample {k}: {terms.size} loss terms for {trained.size} trained tokens"
    )
    if not terms.size:
        return
    assert np.array_equal(row.targets.numpy()[terms], sample.input_ids[trained]), f"sample {k}: targets"
    assert np.array_equal(row.advantages.numpy()[terms], sample.advantages), f"sample {k}: advantages"
    assert np.array_equal(row.sampler_logprobs.numpy()[terms], sample.sampler_logprobs), (
        f"sample {k}: logprobs"
    )
    path = token_path(row, int(row.token_index[terms[-1]])).numpy()
    assert np.array_equal(row.input_ids.numpy()[path], sample.input_ids[: trained[-1]]), f"sample {k}: path"
    assert np.array_equal(path[trained - 1], row.token_index.numpy()[terms]), f"sample {k}: off its path"
    if row.sampler_top_ids is not None:
        top = sample.sampler_top_ids.reshape(trained.size, -1)
        assert np.array_equal(row.sampler_top_ids.numpy()[terms, : top.shape[1]], top), f"sample {k}: top ids"
    if row.sampling_mask_ids is not None:
        offsets, ids = row.sampling_mask_offsets.numpy(), row.sampling_mask_ids.numpy()
        for t, m in enumerate(terms):
            assert np.array_equal(ids[offsets[m] : offsets[m + 1]], sample.sampling_mask[t]), (
                f"sample {k}: mask"
            )


def _check_routes(row: PackedRow, samples: Sequence[PackSample]) -> None:
    """The route rule of `PackedRow`, token by token: first route written wins, other expert sets conflict."""
    routed = [s for s in samples if s.routed_experts is not None]
    if not routed:
        assert row.routed_experts is None and row.route_conflicts == 0, "routes appeared from nowhere"
        return
    assert row.routed_experts is not None and row.routed_experts.dtype.is_signed, "routes went missing"
    kept: dict[int, np.ndarray] = {}
    conflicts = 0
    for k, sample in enumerate(samples):
        terms = np.flatnonzero(row.sample_index.numpy() == k)
        if sample.routed_experts is None or not terms.size:
            continue
        path = token_path(row, int(row.token_index[terms[-1]])).tolist()
        for depth, position in enumerate(path):
            route = sample.routed_experts[depth]
            if (route == -1).all():
                continue
            if position not in kept:
                kept[position] = route
            elif not np.array_equal(np.sort(kept[position], -1), np.sort(route, -1)):
                conflicts += 1
    expected = np.full(tuple(row.routed_experts.shape), -1, dtype=np.int16)
    for position, route in kept.items():
        expected[position] = route
    assert np.array_equal(row.routed_experts.numpy(), expected), "routed_experts breaks first-route-wins"
    assert row.route_conflicts == conflicts, f"route_conflicts {row.route_conflicts}, expected {conflicts}"


def assert_row_layout(row: PackedRow, samples: Sequence[PackSample], *, shared: bool = True) -> None:
    """Raise AssertionError unless `row` is a valid packing of `samples` (in order of add). `shared=False`
    accepts rows that repeat common prefixes (plain mode, `TreeRow(..., share_prefixes=False)`)."""
    assert row.num_samples == len(samples), f"row holds {row.num_samples} samples, expected {len(samples)}"
    assert row.num_raw_tokens == sum(s.num_tokens for s in samples)
    q, parents = _check_segments(row)
    _next_tokens(row, q, parents, shared)
    assert row.num_loss_terms == sum(int(s.trained_mask.sum()) for s in samples)
    for k, sample in enumerate(samples):
        _check_sample(row, k, sample)
    _check_routes(row, samples)
