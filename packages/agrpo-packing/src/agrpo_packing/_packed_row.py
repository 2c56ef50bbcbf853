"""`PackedRow`: the tensors of one packed row, the contract between packing and attention.

Owns the layout and its documented invariants. Does not know how the trie was built (`TreeRow`) nor
how attention consumes it (agrpo-attention).

Legend: N = unique packed tokens, S = segments, P = total path length over segments
(sum of each segment's root-to-segment K/V length), M = loss terms, K = sampler top-K.

Layout: segments are maximal unforked chains of trie nodes, laid out depth-first, so segment s owns
the contiguous packed positions `q_offsets[s]:q_offsets[s+1]` and its parent comes before it.
Attention for segment s: queries = its own positions; keys/values = `kv_index[kv_offsets[s]:
kv_offsets[s+1]]` (ancestor positions root first, then its own), causal, aligned bottom-right (the
last query sees every key). This is exactly the varlen (cu_seqlens) calling convention after
gathering K/V with `kv_index`. Segments are in depth-first pre-order, so a segment's descendants are
the contiguous segments right after it.

As `TreeRow` builds it: trie nodes are keyed on (token, next token), so every position predicts exactly
one token (siblings may hold the same token with different successors: forks happen one token early);
a sample's tokens from its last trained token on predict no loss term and are not forwarded. Loss
terms are grouped by sample in order of `TreeRow.add`, each sample's in sequence order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(kw_only=True, slots=True)
class PackedRow:
    """One DP rank's forward in one micro-batch: unique tokens plus the index tensors that recover
    every sample's own causal context. All tensors are int64/float32 on CPU until `.to(device)`."""

    input_ids: torch.Tensor
    """(N,) unique token ids, depth-first."""
    position_ids: torch.Tensor
    """(N,) each token's depth in its sample (0 for a sequence's first token)."""
    q_offsets: torch.Tensor
    """(S + 1,) segment s's queries are positions `q_offsets[s]:q_offsets[s+1]`; tiles [0, N)."""
    kv_index: torch.Tensor
    """(P,) packed positions of each segment's root-to-segment path, segment after segment."""
    kv_offsets: torch.Tensor
    """(S + 1,) segment s's path is `kv_index[kv_offsets[s]:kv_offsets[s+1]]`."""
    segment_parent: torch.Tensor
    """(S,) index of the parent segment, -1 for a root; a parent always precedes its children."""
    token_index: torch.Tensor
    """(M,) packed position whose logits predict each loss term's target."""
    targets: torch.Tensor
    """(M,) target token id of each loss term."""
    advantages: torch.Tensor
    """(M,) float32."""
    sampler_logprobs: torch.Tensor
    """(M,) float32 log-prob of the target under the sampler."""
    sample_index: torch.Tensor
    """(M,) index, in order of `TreeRow.add`, of the sample each loss term belongs to."""
    num_samples: int
    """Samples packed into this row."""
    num_raw_tokens: int
    """Sum of the samples' lengths: what plain packing would forward."""
    sampler_top_ids: torch.Tensor | None = None
    """(M, K) int64, -1 padded; present when every sample carried it."""
    sampler_top_logprobs: torch.Tensor | None = None
    """(M, K) float32, -inf padded."""
    sampling_mask_ids: torch.Tensor | None = None
    """Flat int64 candidate ids of every loss term's sampling set, term after term."""
    sampling_mask_offsets: torch.Tensor | None = None
    """(M + 1,) loss term m's set is `sampling_mask_ids[offsets[m]:offsets[m+1]]`."""
    routed_experts: torch.Tensor | None = None
    """(N, num_hidden_layers, top_k) int16 experts the sampler routed each packed token to (MoE routing
    replay), aligned with `input_ids`; -1 in every slot of a token without a route (it routes live). Entries
    of non-MoE layers are zeros and ignored."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.segment_parent.shape[0])

    @property
    def num_loss_terms(self) -> int:
        return int(self.token_index.shape[0])

    @property
    def is_plain(self) -> bool:
        """True when no segment has a parent: ordinary varlen packing, `kv_index` is `arange(N)` and
        `q_offsets` is the usual `cu_seqlens`, so attention needs no gather."""
        return bool((self.segment_parent < 0).all())

    @property
    def packing_ratio(self) -> float:
        """Raw tokens per forwarded token: 1.0 when nothing is shared (a hair above: tokens after each
        sample's last trained token are not forwarded)."""
        return self.num_raw_tokens / max(self.num_tokens, 1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """A copy with every tensor on `device` (pinned-memory CPU tensors copy asynchronously)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = (
                value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
            )
        return PackedRow(**moved)
