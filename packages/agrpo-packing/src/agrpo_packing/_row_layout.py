"""`build_packed_row`: lays a row's sorted trie out as `PackedRow` tensors.

Owns the depth-first layout, segmentation, K/V paths and loss terms. Does not know budgets or how
entries were admitted (`TreeRow`), nor attention.

Input: the row's entries in order of `add`, the same entries (those with nodes) sorted by key, and for
each sorted entry `shared[k]`, the nodes it shares with its sorted predecessor. Emitting each sorted
entry's novel nodes (depths `shared[k]:num_nodes`) one after another is a depth-first pre-order of the
trie, so the work is per entry and per segment, never per token: tokens move with numpy slices.

Trie shape from the sorted list: entry k's first novel node hangs off node (o, shared[k] - 1), where
the owner o is the nearest earlier emitting entry with `shared[o] < shared[k]` (it emitted that node).
A node forks when it has two or more children (its owner's own continuation counts as one); segments
break at forks only, so a child segment always hangs off its parent segment's last token, and a lone
child at the end of its owner's path simply continues the owner's segment.

MoE routes (`_routes`) are written per entry in order of add along its whole path: a position takes the
first route written there; a later sample with another expert set there counts one route conflict. The
work is per entry over its path (the raw tokens), with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._exceptions import PackingError
from ._packed_row import PackedRow
from ._trie_entry import TrieEntry


@dataclass(slots=True)
class _SortedTrie:
    """Per sorted entry (Python ints; entries are few, tokens are many)."""

    start: list[int]
    """First novel depth (= nodes shared with the sorted predecessor)."""
    stop: list[int]
    """Nodes of the entry (its path ends at depth stop - 1)."""
    base: list[int]
    """Packed position of the first novel node."""
    owner: list[int]
    """Sorted index of the entry that emitted node (k, start - 1); -1 for roots."""
    num_tokens: int


def multi_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of `arange(s, s + n)` for each (s, n), in one vectorised pass."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    offsets = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths)


def _sorted_trie(sorted_entries: Sequence[TrieEntry], shared: Sequence[int]) -> _SortedTrie:
    start, stop = list(shared), [e.num_nodes for e in sorted_entries]
    base, owner, stack, cursor = [], [], [], 0
    for k, (s, n) in enumerate(zip(start, stop, strict=True)):
        base.append(cursor)
        while stack and start[stack[-1]] >= s:
            stack.pop()
        owner.append(stack[-1] if stack else -1)
        if n > s:  # emits novel nodes; duplicates (n == s) are never owners
            stack.append(k)
            cursor += n - s
    return _SortedTrie(start, stop, base, owner, cursor)


def _segment_starts(trie: _SortedTrie) -> tuple[list[int], list[int]]:
    """Packed start position of every segment and the packed position of the node it hangs off."""
    starts, parents = [], []
    children: dict[tuple[int, int], list[int]] = {}
    for k, (s, n) in enumerate(zip(trie.start, trie.stop, strict=True)):
        if n == s:
            continue
        if s == 0:
            starts.append(trie.base[k])
            parents.append(-1)
        else:
            children.setdefault((trie.owner[k], s), []).append(k)
    for (o, depth), kids in children.items():
        continues = depth < trie.stop[o]
        if not continues and len(kids) == 1:
            continue  # the only child of the owner's last node: same segment
        parent_node = trie.base[o] + depth - 1 - trie.start[o]
        starts += [trie.base[k] for k in kids]
        parents += [parent_node] * len(kids)
        if continues:
            starts.append(parent_node + 1)
            parents.append(parent_node)
    return starts, parents


def _segments(trie: _SortedTrie) -> tuple[np.ndarray, np.ndarray]:
    """(q_offsets (S + 1,), segment_parent (S,)) in depth-first order."""
    starts, parents = _segment_starts(trie)
    order = np.argsort(np.asarray(starts, dtype=np.int64), kind="stable")
    begin = np.asarray(starts, dtype=np.int64)[order]
    parent_node = np.asarray(parents, dtype=np.int64)[order]
    assert begin.size == 0 or (begin[0] == 0 and np.all(np.diff(begin) > 0)), "segments must tile the row"
    q_offsets = np.append(begin, trie.num_tokens)
    segment_parent = np.searchsorted(begin, parent_node, side="right") - 1
    segment_parent[parent_node < 0] = -1
    return q_offsets, segment_parent


def _segment_paths(q_offsets: np.ndarray, segment_parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kv_index (P,), kv_offsets (S + 1,)): each segment's ancestors root first, then itself."""
    paths: list[list[int]] = []
    for s, p in enumerate(segment_parent.tolist()):
        paths.append([*paths[p], s] if p >= 0 else [s])
    flat = np.fromiter((s for path in paths for s in path), dtype=np.int64)
    lengths = np.diff(q_offsets)
    kv_index = multi_arange(q_offsets[:-1][flat], lengths[flat])
    path_lengths = np.fromiter((len(path) for path in paths), dtype=np.int64, count=len(paths))
    ends = np.cumsum(lengths[flat])[np.cumsum(path_lengths) - 1] if flat.size else flat
    return kv_index, np.concatenate([[0], ends]).astype(np.int64)


def _predicting_positions(trie: _SortedTrie, k: int, depths: np.ndarray) -> np.ndarray:
    """Packed positions of the nodes at `depths` (ascending) on sorted entry k's path."""
    if depths.size == 0 or depths[0] >= trie.start[k]:
        return depths + (trie.base[k] - trie.start[k])
    out = np.empty_like(depths)
    pending = np.arange(depths.shape[0])
    while pending.size:
        assert k >= 0, "a depth above every owner's start cannot happen: roots start at 0"
        d = depths[pending]
        own = d >= trie.start[k]
        out[pending[own]] = d[own] + (trie.base[k] - trie.start[k])
        pending, k = pending[~own], trie.owner[k]
    return out


def _loss_terms(entries: Sequence[TrieEntry], sorted_entries: Sequence[TrieEntry], trie: _SortedTrie) -> dict:
    sorted_index = {id(e): k for k, e in enumerate(sorted_entries)}
    token_index, targets = [], []
    for entry in entries:
        if entry.num_loss_terms:
            positions = entry.trained_positions
            token_index.append(_predicting_positions(trie, sorted_index[id(entry)], positions - 1))
            targets.append(entry.sample.input_ids[positions])
    counts = np.fromiter((e.num_loss_terms for e in entries), dtype=np.int64, count=len(entries))
    samples = [e.sample for e in entries]
    return {
        "token_index": _cat(token_index, np.int64),
        "targets": _cat(targets, np.int64),
        "advantages": _cat([s.advantages for s in samples], np.float32),
        "sampler_logprobs": _cat([s.sampler_logprobs for s in samples], np.float32),
        "sample_index": np.repeat(np.arange(len(entries), dtype=np.int64), counts),
    }


def _cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)


def _sampler_top(entries: Sequence[TrieEntry], num_terms: int) -> dict:
    tops = [e.sample.sampler_top_ids for e in entries]
    if not entries or any(t is None for t in tops):
        return {}
    width = max((t.shape[1] if t.ndim == 2 else 0) for t in tops)
    ids = np.full((num_terms, width), -1, dtype=np.int64)
    logprobs = np.full((num_terms, width), -np.inf, dtype=np.float32)
    row = 0
    for entry, top in zip(entries, tops, strict=True):
        rows = top.shape[0]
        if rows and top.ndim == 2:
            ids[row : row + rows, : top.shape[1]] = top
            logprobs[row : row + rows, : top.shape[1]] = entry.sample.sampler_top_logprobs
        row += rows
    return {"sampler_top_ids": ids, "sampler_top_logprobs": logprobs}


def _sampling_mask(entries: Sequence[TrieEntry]) -> dict:
    masks = [e.sample.sampling_mask for e in entries]
    if not entries or any(m is None for m in masks):
        return {}
    sets = [np.asarray(s, dtype=np.int64).reshape(-1) for m in masks for s in m]
    lengths = np.fromiter((s.shape[0] for s in sets), dtype=np.int64, count=len(sets))
    return {
        "sampling_mask_ids": _cat(sets, np.int64),
        "sampling_mask_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }


def _token_rows(routes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, E * k) int16 rows of an (n, E, k) route array, and the same rows as one opaque (n,) void array
    each, so that "has a route" is one memcmp per token that stops at its first expert id."""
    rows = np.ascontiguousarray(routes).reshape(routes.shape[0], -1)
    return rows, rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)


def _slice_or_take(rows: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """`rows[picked]`; a view when the picked rows are consecutive (a shared prefix), else a copy."""
    index = np.flatnonzero(picked)
    if index.size and index[-1] - index[0] + 1 == index.size:
        return rows[index[0] : index[-1] + 1]
    return rows[index]


def _routes(entries: Sequence[TrieEntry], sorted_entries: Sequence[TrieEntry], trie: _SortedTrie) -> dict:
    """`routed_experts` (N, E, k) and `route_conflicts` (see the module and `PackedRow` docstrings)."""
    routed = [e for e in entries if e.sample.routed_experts is not None]
    if not routed:
        return {}
    shapes = sorted({e.sample.routed_experts.shape[1:] for e in routed})
    if len(shapes) > 1:
        raise PackingError(
            f"samples of one row carry routes of different (num_layers, top_k): {shapes}; every sample's "
            "routed_experts must come from the same model"
        )
    width = int(np.prod(shapes[0]))
    out = np.empty((trie.num_tokens, width), dtype=np.int16)
    filled = np.zeros(trie.num_tokens, dtype=bool)
    no_route = _token_rows(np.full((1, width, 1), -1, dtype=np.int16))[1][0]
    sorted_index = {id(e): k for k, e in enumerate(sorted_entries)}
    conflicts = 0
    for entry in routed:
        if not entry.num_nodes:
            continue
        positions = _predicting_positions(trie, sorted_index[id(entry)], np.arange(entry.num_nodes))
        rows, opaque = _token_rows(entry.sample.routed_experts[: entry.num_nodes])
        has = opaque != no_route
        new = has & ~filled[positions]
        out[positions[new]] = _slice_or_take(rows, new)
        filled[positions[new]] = True
        again = has & ~new
        if not again.any():
            continue
        kept, mine = out[positions[again]], _slice_or_take(rows, again)
        differ = (kept != mine).any(axis=1)
        if differ.any():  # same experts in another order is the same route
            kept = np.sort(kept[differ].reshape(-1, *shapes[0]), axis=-1)
            mine = np.sort(mine[differ].reshape(-1, *shapes[0]), axis=-1)
            conflicts += int((kept != mine).any(axis=(1, 2)).sum())
    out[~filled] = -1
    return {"routed_experts": out.reshape(trie.num_tokens, *shapes[0]), "route_conflicts": conflicts}


def build_packed_row(
    entries: Sequence[TrieEntry], sorted_entries: Sequence[TrieEntry], shared: Sequence[int]
) -> PackedRow:
    """The `PackedRow` of a trie given as sorted entries with predecessor-shared node counts."""
    trie = _sorted_trie(sorted_entries, shared)
    novel = [(e.tokens[s:n], s, n - s) for e, s, n in zip(sorted_entries, trie.start, trie.stop, strict=True)]
    input_ids = _cat([t for t, _, m in novel if m], np.int64)
    position_ids = multi_arange(np.array([s for _, s, _ in novel]), np.array([m for _, _, m in novel]))
    q_offsets, segment_parent = _segments(trie)
    kv_index, kv_offsets = _segment_paths(q_offsets, segment_parent)
    arrays = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "q_offsets": q_offsets,
        "kv_index": kv_index,
        "kv_offsets": kv_offsets,
        "segment_parent": segment_parent.astype(np.int64),
        **_loss_terms(entries, sorted_entries, trie),
    }
    arrays |= _sampler_top(entries, arrays["token_index"].shape[0]) | _sampling_mask(entries)
    routes = _routes(entries, sorted_entries, trie)
    arrays |= {k: v for k, v in routes.items() if k == "routed_experts"}
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    raw = sum(e.sample.num_tokens for e in entries)
    conflicts = routes.get("route_conflicts", 0)
    return PackedRow(**tensors, num_samples=len(entries), num_raw_tokens=raw, route_conflicts=conflicts)
