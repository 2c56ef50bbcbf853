"""`DeltaNetPlan`: the index tensors tree Gated DeltaNet layers read, built once per forward.

Owns the layouts derived from a `PackedRow`, all built on the host (numpy) and copied once per row:
- the path convolution's halo layout (the PyTorch definition): each segment is preceded by the K-1 tokens
  that precede it on its own root-to-segment path (its parent's last tokens, then further up; zeros past
  the root), so one ordinary depthwise conv1d over the concatenation gives every token exactly the window
  it has when its sample runs alone (cost: (K-1) extra rows per segment);
- the same windows as tables for a kernel that reads tokens in place (`ConvTables`): each token's K-1 path
  predecessors, and, for the few tokens that precede something other than the token j places after them
  (a fork's last K-1 tokens), the list of all their successors, for the input gradient;
- the scan levels: segments grouped by depth in the segment tree. Level l holds segments whose parent
  is at level l-1, so one varlen delta-rule call per level runs every segment of the level, each
  starting from its parent's final state (row `parent_slot` of level l-1's final states);
- the same tree as tables for kernels that scan segments in place (`SegmentTables`: parents, children,
  segments by level, and the 64-token chunks of every segment, the chunk of the chunked rule).
Does not know the delta rule's math (only its chunk size) nor any kernel.

Legend: N = packed tokens, S = segments, K = conv taps, E = N + S * (K - 1), T_l = tokens at level l,
L = levels, NT = chunks, X = fork tokens, F = their successors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agrpo_packing import PackedRow

from ._delta_rule_torch import CHUNK_SIZE
from ._tree_layout import host_to_device


@dataclass(kw_only=True, slots=True, frozen=True)
class DeltaNetLevel:
    """The segments of one depth of the segment tree, as one varlen batch."""

    token_index: torch.Tensor
    """(T_l,) int64 packed positions of the level's segments, segment after segment."""
    cu_seqlens: torch.Tensor
    """(n_l + 1,) int64 offsets of each segment in `token_index`."""
    cu_seqlens_host: tuple[int, ...]
    """`cu_seqlens` on the host."""
    parent_slot: torch.Tensor | None
    """(n_l,) int64 row of each segment's parent among the previous level's final states; None at level 0."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SegmentTables:
    """The segment tree as int32 tables over packed positions, for kernels that need no gather."""

    offsets: torch.Tensor
    """(S + 1,) first packed position of each segment (segments are contiguous)."""
    parent: torch.Tensor
    """(S,) parent segment, -1 for a root."""
    child_offsets: torch.Tensor
    """(S + 1,) segment s's children are `children[child_offsets[s]:child_offsets[s + 1]]`."""
    children: torch.Tensor
    """(S - roots,) children of every segment, parent after parent."""
    level_segments: torch.Tensor
    """(S,) segments by level, roots first."""
    level_offsets_host: torch.Tensor
    """(L + 1,) int64 on the host: level l is `level_segments[level_offsets_host[l]:level_offsets_host[l + 1]]`."""
    chunk_offsets: torch.Tensor
    """(S + 1,) first chunk of each segment in `chunk_table`."""
    chunk_table: torch.Tensor
    """(NT, 2) (segment, chunk within it) of every chunk of `CHUNK_SIZE` tokens, segment after segment."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ConvTables:
    """Each token's convolution window as positions of the packed row, for a kernel that reads in place."""

    predecessors: torch.Tensor
    """(N, K - 1) int32: column j - 1 holds the token j steps back on the token's path, -1 past the root."""
    fork_tokens: torch.Tensor
    """(X,) int32 tokens with a successor other than `token + j` at some tap j (a fork's last K-1 tokens)."""
    fork_offsets: torch.Tensor
    """(X + 1,) int32: fork token x's successors are `fork_successors[fork_offsets[x]:fork_offsets[x + 1]]`."""
    fork_successors: torch.Tensor
    """(F, 2) int32 (token t, tap j) of every t whose predecessor j is the fork token (adjacent ones too), and
    (the fork token, 0)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DeltaNetPlan:
    """Everything a tree Gated DeltaNet layer needs beyond its own weights."""

    conv_kernel_size: int
    """K, the short convolution's taps (Qwen3.5: 4)."""
    halo_index: torch.Tensor
    """(E,) int64 rows of [hidden; zero row] to convolve: per segment K-1 path predecessors, then itself."""
    conv_out_index: torch.Tensor
    """(N,) int64 column of the valid conv1d output that belongs to each packed position."""
    levels: tuple[DeltaNetLevel, ...]
    """Scan levels, roots first."""
    inverse_order: torch.Tensor
    """(N,) int64 index into the concatenated level outputs for each packed position."""
    segments: SegmentTables
    """The segment tree for the fused Triton delta rule."""
    conv: ConvTables
    """The windows for the Triton path convolution."""


def _halo_layout(row: PackedRow, taps: int) -> tuple[np.ndarray, np.ndarray]:
    q_off = row.q_offsets.cpu().numpy().astype(np.int64)
    kv_off = row.kv_offsets.cpu().numpy().astype(np.int64)
    kv_index = row.kv_index.cpu().numpy().astype(np.int64)
    n, halo = int(q_off[-1]), taps - 1
    pieces = []
    for s in range(q_off.shape[0] - 1):
        ancestors = kv_index[kv_off[s] : kv_off[s + 1] - (q_off[s + 1] - q_off[s])]
        window = ancestors[max(0, ancestors.shape[0] - halo) :]
        pieces += [np.full(halo - window.shape[0], n), window, np.arange(q_off[s], q_off[s + 1])]
    segment_of = np.repeat(np.arange(q_off.shape[0] - 1), np.diff(q_off))
    return np.concatenate(pieces).astype(np.int64), np.arange(n) + segment_of * halo


def _levels(row: PackedRow, device, non_blocking: bool):
    """(levels, packed order of the concatenated levels, each level's segments)."""
    q_off = row.q_offsets.cpu().numpy().astype(np.int64)
    parents = row.segment_parent.cpu().numpy().astype(np.int64)
    depth = np.zeros(parents.shape[0], dtype=np.int64)
    for s, parent in enumerate(parents):
        depth[s] = depth[parent] + 1 if parent >= 0 else 0
    slot = np.zeros_like(depth)
    levels, order, by_level = [], [], []
    for level in range(int(depth.max(initial=-1)) + 1):
        segments = np.flatnonzero(depth == level)
        slot[segments] = np.arange(segments.shape[0])
        lengths = q_off[segments + 1] - q_off[segments]
        tokens = np.concatenate([np.arange(q_off[s], q_off[s + 1]) for s in segments])
        cu = np.concatenate([[0], np.cumsum(lengths)])
        parent_slot = (
            None if level == 0 else host_to_device(slot[parents[segments]], device, non_blocking=non_blocking)
        )
        levels.append(
            DeltaNetLevel(
                token_index=host_to_device(tokens, device, non_blocking=non_blocking),
                cu_seqlens=host_to_device(cu, device, non_blocking=non_blocking),
                cu_seqlens_host=tuple(int(x) for x in cu),
                parent_slot=parent_slot,
            )
        )
        order.append(tokens)
        by_level.append(segments)
    return tuple(levels), np.concatenate(order) if order else np.zeros(0, dtype=np.int64), by_level


def chunk_table(lengths: np.ndarray, chunk: int = CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """int32 (S + 1,) first chunk of each sequence and (NT, 2) (sequence, chunk within it) of every chunk of
    sequences of `lengths` tokens; an empty sequence has no chunk."""
    counts = -(-np.asarray(lengths, dtype=np.int64) // chunk)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    sequence = np.repeat(np.arange(counts.shape[0]), counts)
    local = np.arange(sequence.shape[0]) - offsets[sequence]
    return offsets, np.stack([sequence, local], axis=1).astype(np.int32).reshape(-1, 2)


def _int32(x, device, non_blocking: bool) -> torch.Tensor:
    return host_to_device(np.ascontiguousarray(x, dtype=np.int32), device, non_blocking=non_blocking)


def _segment_tables(row: PackedRow, levels: list[np.ndarray], device, non_blocking: bool) -> SegmentTables:
    q_off = row.q_offsets.cpu().numpy().astype(np.int64)
    parents = row.segment_parent.cpu().numpy().astype(np.int64)
    has_parent = np.flatnonzero(parents >= 0)
    children = has_parent[np.argsort(parents[has_parent], kind="stable")]
    child_counts = np.bincount(parents[has_parent], minlength=parents.shape[0])
    chunk_offsets, table = chunk_table(np.diff(q_off))
    level_sizes = [0] + [segments.shape[0] for segments in levels]
    return SegmentTables(
        offsets=_int32(q_off, device, non_blocking),
        parent=_int32(parents, device, non_blocking),
        child_offsets=_int32(np.concatenate([[0], np.cumsum(child_counts)]), device, non_blocking),
        children=_int32(children, device, non_blocking),
        level_segments=_int32(np.concatenate(levels) if levels else np.zeros(0), device, non_blocking),
        level_offsets_host=torch.from_numpy(np.cumsum(level_sizes).astype(np.int64)),
        chunk_offsets=_int32(chunk_offsets, device, non_blocking),
        chunk_table=_int32(table, device, non_blocking),
    )


def _conv_tables(
    halo_index: np.ndarray, conv_out_index: np.ndarray, taps: int, device, non_blocking
) -> ConvTables:
    n = conv_out_index.shape[0]
    own = conv_out_index + taps - 1  # each token's row in the halo layout
    predecessors = halo_index[own[:, None] - np.arange(1, taps)[None, :]].reshape(n, taps - 1)
    predecessors = np.where(predecessors == n, -1, predecessors)  # (N, K - 1); n is the zero row
    token, column = np.nonzero(predecessors >= 0)
    source, tap = predecessors[token, column], column + 1
    forks = np.unique(source[source != token - tap])
    listed = np.flatnonzero(np.isin(source, forks))
    # every successor (t, j) of each fork token, and the token itself as (fork, 0), grouped by fork token
    pairs = np.concatenate([np.stack([token[listed], tap[listed]], 1), np.stack([forks, 0 * forks], 1)])
    owner = np.concatenate([source[listed], forks])
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(np.searchsorted(forks, owner), minlength=forks.shape[0])
    return ConvTables(
        predecessors=_int32(predecessors, device, non_blocking),
        fork_tokens=_int32(forks, device, non_blocking),
        fork_offsets=_int32(np.concatenate([[0], np.cumsum(counts)]), device, non_blocking),
        fork_successors=_int32(pairs[order].reshape(-1, 2), device, non_blocking),
    )


def build_deltanet_plan(
    row: PackedRow, conv_kernel_size: int, device: torch.device | str, *, non_blocking: bool = False
) -> DeltaNetPlan:
    """The plan of `row` for layers whose convolution has `conv_kernel_size` taps; `non_blocking`: see
    `host_to_device`."""
    halo_index, conv_out_index = _halo_layout(row, conv_kernel_size)
    levels, order, by_level = _levels(row, device, non_blocking)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.shape[0])
    return DeltaNetPlan(
        conv_kernel_size=conv_kernel_size,
        halo_index=host_to_device(halo_index, device, non_blocking=non_blocking),
        conv_out_index=host_to_device(conv_out_index, device, non_blocking=non_blocking),
        levels=levels,
        inverse_order=host_to_device(inverse, device, non_blocking=non_blocking),
        segments=_segment_tables(row, by_level, device, non_blocking),
        conv=_conv_tables(halo_index, conv_out_index, conv_kernel_size, device, non_blocking),
    )
