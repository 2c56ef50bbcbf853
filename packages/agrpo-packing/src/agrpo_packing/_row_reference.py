"""Per-sample views of a `PackedRow`: what each sample would see if it were forwarded alone.

Owns the reference side of the packing invariant: `token_path` (the K/V a packed position attends to),
`unpack` (each sample's tokens rebuilt from the row, with the positions that predict its loss terms)
and `reference_logprobs` (loss-term log-probs computed by forwarding each sample alone). Pure torch,
slow by design (one call per sample); meant for tests and debugging, never for training. Does not know
any model: callers pass a callable.

Legend: L = a sample's rebuilt length (through its last trained token), T = its loss terms, M = the
row's loss terms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._packed_row import PackedRow

SequenceLogprobs = Callable[[torch.Tensor], torch.Tensor]
"""`f(input_ids (L,)) -> (L - 1,)`: entry i is log p(input_ids[i + 1] | input_ids[: i + 1])."""


def token_path(row: PackedRow, position: int) -> torch.Tensor:
    """(depth + 1,) packed positions that packed `position` attends to: root first, itself last."""
    if not 0 <= position < row.num_tokens:
        raise IndexError(f"position {position} outside the row's {row.num_tokens} tokens")
    segment = int(torch.searchsorted(row.q_offsets, torch.tensor(position), right=True)) - 1
    kv_start, kv_stop = int(row.kv_offsets[segment]), int(row.kv_offsets[segment + 1])
    after = int(row.q_offsets[segment + 1]) - 1 - position
    return row.kv_index[kv_start : kv_stop - after]


@dataclass(kw_only=True, slots=True)
class UnpackedSample:
    """One sample of a row, rebuilt from the row alone."""

    input_ids: torch.Tensor
    """(L,) the sample's tokens up to and including its last trained token; empty if it has none."""
    loss_positions: torch.Tensor
    """(T,) position in `input_ids` whose next-token prediction is each loss term (trained position - 1)."""
    loss_terms: torch.Tensor
    """(T,) indices of these loss terms in the row."""
    routed_experts: torch.Tensor | None = None
    """(L, E, k) the row's MoE route at each of these tokens (the last one, never forwarded, gets -1); None
    when the row carries no routes."""


def unpack(row: PackedRow) -> list[UnpackedSample]:
    """Every sample of `row`, in order of `TreeRow.add`."""
    out = []
    for k in range(row.num_samples):
        terms = torch.nonzero(row.sample_index == k).flatten()
        if terms.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            out.append(UnpackedSample(input_ids=empty, loss_positions=empty, loss_terms=terms))
            continue
        last = int(terms[-1])
        path = token_path(row, int(row.token_index[last]))
        input_ids = torch.cat([row.input_ids[path], row.targets[last : last + 1]])
        positions = row.position_ids[row.token_index[terms]]
        routes = None
        if row.routed_experts is not None:
            unrouted = row.routed_experts.new_full((1, *row.routed_experts.shape[1:]), -1)
            routes = torch.cat([row.routed_experts[path], unrouted])
        out.append(
            UnpackedSample(
                input_ids=input_ids, loss_positions=positions, loss_terms=terms, routed_experts=routes
            )
        )
    return out


def reference_logprobs(row: PackedRow, sequence_logprobs: SequenceLogprobs) -> torch.Tensor:
    """(M,) each loss term's log-prob from forwarding its sample alone through `sequence_logprobs`."""
    pieces, index = [], []
    for sample in unpack(row):
        if sample.loss_terms.numel():
            logprobs = sequence_logprobs(sample.input_ids)
            pieces.append(logprobs[sample.loss_positions.to(logprobs.device)])
            index.append(sample.loss_terms)
    if not pieces:
        return torch.zeros(0)
    values = torch.cat(pieces)
    order = torch.cat(index).to(values.device)
    return torch.empty_like(values).index_copy(0, order, values)
