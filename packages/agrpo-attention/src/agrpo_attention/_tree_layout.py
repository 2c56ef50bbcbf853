"""`TreeLayout`: the index tensors every attention backend reads, built once per forward from a `PackedRow`.

Owns the translation of the packing contract (segments with contiguous queries, root-to-segment K/V
paths) into what kernels want: int32 cumulative offsets, host-side maxima (so no kernel launch waits
on a device-to-host copy), and `subtree_end`, the depth-first interval that turns "is key j on query
i's path" into one comparison: `j <= i < subtree_end[j]` (segments are laid out depth-first, so a
segment's descendants are the contiguous positions after it). Does not know any kernel, nor how the
row was packed.

Legend: N = packed tokens, S = segments, P = total path length (sum of segment path lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agrpo_packing import PackedRow


@dataclass(kw_only=True, slots=True, frozen=True)
class TreeLayout:
    """Device index tensors plus host-side sizes of one packed row."""

    num_tokens: int
    """N, the packed (unique) tokens."""
    q_offsets: torch.Tensor
    """(S + 1,) int32: segment s's queries are positions `q_offsets[s]:q_offsets[s+1]`."""
    kv_index: torch.Tensor
    """(P,) int64: positions of each segment's root-to-segment path, segment after segment."""
    kv_offsets: torch.Tensor
    """(S + 1,) int32: segment s's path is `kv_index[kv_offsets[s]:kv_offsets[s+1]]`."""
    subtree_end: torch.Tensor
    """(N,) int64: end (exclusive) of the subtree of the segment owning each position."""
    max_q: int
    """Longest segment."""
    max_k: int
    """Longest root-to-segment path."""
    is_flat: bool
    """True when every segment is a root: nothing is shared and `kv_index` is the identity."""
    host_offsets: torch.Tensor
    """(3, S + 1) int64 on the host: `q_offsets`, `kv_offsets` and each segment's parent (-1 for a root; the last
    column is padding). The only host copy of the offsets, and a
    tensor rather than tuples: a compiled decoder layer that is handed the layout then sees a tensor of
    dynamic size, where tuple fields would be guarded on their length (one graph per segment count, seen
    on the H200 with torch 2.11). The tree attention custom op (`_attention_op.py`) rebuilds the layout
    from it without a device sync."""

    @property
    def q_offsets_host(self) -> tuple[int, ...]:
        """`q_offsets` on the host (eager code only: backends' per-segment loops, `prepare`, FLOP counts)."""
        return tuple(self.host_offsets[0].tolist())

    @property
    def kv_offsets_host(self) -> tuple[int, ...]:
        """`kv_offsets` on the host (eager code only)."""
        return tuple(self.host_offsets[1].tolist())

    @property
    def segment_parent_host(self) -> np.ndarray:
        """(S,) parent segment of each segment, -1 for a root (eager code only)."""
        return self.host_offsets[2, :-1].numpy()

    @property
    def num_segments(self) -> int:
        return self.host_offsets.shape[1] - 1

    @property
    def score_pairs(self) -> int:
        """(query, key) pairs attention scores: sum over segments of Lq * Lk - Lq * (Lq - 1) / 2."""
        return self.score_pairs_within(None)

    def score_pairs_within(self, window: int | None) -> int:
        """(query, key) pairs a layer with sliding window `window` scores (None: no window): a query at depth d
        attends to min(d + 1, window) keys of its path."""
        lq, lk = np.diff(self.host_offsets[:2].numpy(), axis=1)
        first = lk - lq  # depth of each segment's first query
        last = lk - 1
        if window is None:
            return int((lq * lk - lq * (lq - 1) // 2).sum())
        # sum over d in [first, last] of min(d + 1, window): the part below the window, then the capped part
        below_end = np.clip(
            np.minimum(last + 1, window - 1), first, None
        )  # depths first..below_end-1 uncapped
        uncapped = (below_end * (below_end + 1) - first * (first + 1)) // 2
        capped = (last + 1 - below_end) * window
        return int((uncapped + capped).sum())


def token_depths(layout: TreeLayout) -> np.ndarray:
    """(N,) depth of every packed token on its root-to-token path (its position id; host, eager code only)."""
    lq, lk = np.diff(layout.host_offsets[:2].numpy(), axis=1)
    starts = layout.host_offsets[0, :-1].numpy()
    return np.arange(layout.num_tokens) - np.repeat(starts - (lk - lq), lq)


def segment_subtree_ends(segment_parent: np.ndarray) -> np.ndarray:
    """(S,) index one past the last segment of each segment's subtree (depth-first order)."""
    last = np.arange(segment_parent.shape[0])
    for s in range(segment_parent.shape[0] - 1, 0, -1):
        parent = segment_parent[s]
        if parent >= 0 and last[s] > last[parent]:
            last[parent] = last[s]
    return last + 1


def host_to_device(
    x: np.ndarray | torch.Tensor, device: torch.device | str, *, non_blocking: bool
) -> torch.Tensor:
    """A host array or tensor on `device`. `non_blocking` (CUDA): staged through pinned memory, so the copy
    is queued on the current stream and the host does not wait for the GPU to drain that stream (a plain
    copy from pageable memory synchronises it)."""
    tensor = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    if non_blocking and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def build_tree_layout(
    row: PackedRow, device: torch.device | str, *, non_blocking: bool = False
) -> TreeLayout:
    """The layout of `row` (host tensors), its tensors on `device`; `non_blocking`: see `host_to_device`."""
    q_offsets = row.q_offsets.detach().cpu().numpy().astype(np.int64)
    kv_offsets = row.kv_offsets.detach().cpu().numpy().astype(np.int64)
    parents = row.segment_parent.detach().cpu().numpy().astype(np.int64)
    seg_len = np.diff(q_offsets)
    parent_row = np.append(parents, -1)
    end_of_segment = q_offsets[segment_subtree_ends(parents)]
    subtree_end = np.repeat(end_of_segment, seg_len)
    return TreeLayout(
        num_tokens=int(q_offsets[-1]),
        q_offsets=host_to_device(q_offsets.astype(np.int32), device, non_blocking=non_blocking),
        kv_index=host_to_device(row.kv_index.to(torch.int64), device, non_blocking=non_blocking),
        kv_offsets=host_to_device(kv_offsets.astype(np.int32), device, non_blocking=non_blocking),
        subtree_end=host_to_device(subtree_end, device, non_blocking=non_blocking),
        max_q=int(seg_len.max(initial=0)),
        max_k=int(np.diff(kv_offsets).max(initial=0)),
        is_flat=bool((parents < 0).all()),
        host_offsets=torch.from_numpy(np.stack([q_offsets, kv_offsets, parent_row])),
    )


def layout_from_tensors(
    q_offsets: torch.Tensor,
    kv_index: torch.Tensor,
    kv_offsets: torch.Tensor,
    subtree_end: torch.Tensor,
    host_offsets: torch.Tensor,
) -> TreeLayout:
    """The layout whose tensors these are (the host fields recomputed from `host_offsets`): what the tree
    attention custom op sees of a `TreeLayout`, since a custom op takes tensors only."""
    seg_len, path_len = np.diff(host_offsets[:2].numpy(), axis=1)
    return TreeLayout(
        num_tokens=int(host_offsets[0, -1]),
        q_offsets=q_offsets,
        kv_index=kv_index,
        kv_offsets=kv_offsets,
        subtree_end=subtree_end,
        max_q=int(seg_len.max(initial=0)),
        max_k=int(path_len.max(initial=0)),
        is_flat=bool((seg_len == path_len).all()),  # a path no longer than its segment has no ancestor
        host_offsets=host_offsets,
    )
