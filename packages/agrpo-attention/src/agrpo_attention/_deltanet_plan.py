"""`DeltaNetPlan`: the index tensors tree Gated DeltaNet layers read, built once per forward.

Owns two layouts derived from a `PackedRow`:
- the path convolution's halo layout: each segment is preceded by the K-1 tokens that precede it on
  its own root-to-segment path (its parent's last tokens, then further up; zeros past the root), so
  one ordinary depthwise conv1d over the concatenation gives every token exactly the window it has
  when its sample runs alone (cost: (K-1) extra rows per segment);
- the scan levels: segments grouped by depth in the segment tree. Level l holds segments whose parent
  is at level l-1, so one varlen delta-rule call per level runs every segment of the level, each
  starting from its parent's final state (row `parent_slot` of level l-1's final states).
Does not know the delta rule's math nor any kernel.

Legend: N = packed tokens, S = segments, K = conv taps, E = N + S * (K - 1), T_l = tokens at level l.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agrpo_packing import PackedRow

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


def _levels(row: PackedRow, device, non_blocking: bool) -> tuple[tuple[DeltaNetLevel, ...], np.ndarray]:
    q_off = row.q_offsets.cpu().numpy().astype(np.int64)
    parents = row.segment_parent.cpu().numpy().astype(np.int64)
    depth = np.zeros(parents.shape[0], dtype=np.int64)
    for s, parent in enumerate(parents):
        depth[s] = depth[parent] + 1 if parent >= 0 else 0
    slot = np.zeros_like(depth)
    levels, order = [], []
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
    return tuple(levels), np.concatenate(order) if order else np.zeros(0, dtype=np.int64)


def build_deltanet_plan(
    row: PackedRow, conv_kernel_size: int, device: torch.device | str, *, non_blocking: bool = False
) -> DeltaNetPlan:
    """The plan of `row` for layers whose convolution has `conv_kernel_size` taps; `non_blocking`: see
    `host_to_device`."""
    halo_index, conv_out_index = _halo_layout(row, conv_kernel_size)
    levels, order = _levels(row, device, non_blocking)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.shape[0])
    return DeltaNetPlan(
        conv_kernel_size=conv_kernel_size,
        halo_index=host_to_device(halo_index, device, non_blocking=non_blocking),
        conv_out_index=host_to_device(conv_out_index, device, non_blocking=non_blocking),
        levels=levels,
        inverse_order=host_to_device(inverse, device, non_blocking=non_blocking),
    )
