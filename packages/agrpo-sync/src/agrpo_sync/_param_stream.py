"""`ParamStream`: the trainer's weights as full tensors, in checkpoint names, gathered in bounded buckets.

Owns which parameters are sent (frozen non-text towers of vision-language models are skipped, and names the
sync keeps out, such as the frozen routed experts a CPU server must keep: `_start_checks.py`), their
wire names (wrapper segments such as `_checkpoint_wrapped_module` and `_orig_mod` removed), their wire
dtype, and the FSDP2 gather: parameters are grouped into buckets of at most `bucket_bytes` of full
tensors and each bucket's `DTensor.full_tensor()` all-gathers run together, so at most one bucket of
full tensors (plus what the consumer still holds) exists at a time, never the whole model.

Every trainer rank must iterate the same stream in lockstep, since `full_tensor()` is a collective;
only the sending rank uses the tensors, the others `drain()`. Does not know where the tensors go.
What a LoRA model contributes (merged weights or the adapter alone) is decided by `_lora_weights.py`,
which builds `WireEntry` lists for this stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ._wire_format import TensorMeta

# Segments wrappers insert into parameter names; checkpoints never have them.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class WireEntry:
    """One sent tensor: its metadata, the local parameters it is computed from, and how."""

    meta: TensorMeta
    sources: tuple[torch.Tensor, ...]
    combine: Combine | None = None
    """Maps the sources' full tensors to the sent tensor; None sends the single source as is."""

    @property
    def source_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.dtype.itemsize for p in self.sources)


def clean_name(name: str) -> str:
    """The checkpoint name of a parameter: wrapper segments removed."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def frozen_non_text(named: list[tuple[str, torch.Tensor]], non_text: tuple[str, ...]) -> set[str]:
    """Names of parameters under a non-text module (e.g. `visual`) whose parameters are all frozen."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, param in named:
        segments = name.split(".")
        for index, segment in enumerate(segments):
            if segment in non_text:
                groups.setdefault(".".join(segments[: index + 1]), []).append((name, param))
                break
    return {n for items in groups.values() if not any(p.requires_grad for _, p in items) for n, _ in items}


def plain_entries(
    model: torch.nn.Module,
    dtype: torch.dtype | None,
    non_text: tuple[str, ...],
    kept: frozenset[str] = frozenset(),
) -> list[WireEntry]:
    """One entry per parameter of a model without adapters, frozen non-text towers and `kept` names left out."""
    named = list(model.named_parameters())
    skipped = frozen_non_text(named, non_text) | kept
    return [
        WireEntry(meta=TensorMeta(clean_name(n), dtype or p.dtype, tuple(p.shape)), sources=(p,))
        for n, p in named
        if n not in skipped
    ]


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an all-gather for an FSDP2 `DTensor` (a collective), the tensor itself otherwise."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def plan_buckets(entries: list[WireEntry], bucket_bytes: int) -> list[list[WireEntry]]:
    """Consecutive groups of entries whose full sources total at most `bucket_bytes` (at least one each)."""
    buckets: list[list[WireEntry]] = []
    current: list[WireEntry] = []
    size = 0
    for entry in entries:
        if current and size + entry.source_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.source_bytes
    if current:
        buckets.append(current)
    return buckets


class ParamStream:
    """The sent tensors of one model for one sync, as metadata (no gather) and as gathered buckets.

    Single use: the buckets are gathered once, in order, whoever iterates; `drain()` after a failure
    gathers only the buckets nobody took yet, so every rank still runs the same collectives.
    """

    def __init__(self, entries: list[WireEntry], *, bucket_bytes: int) -> None:
        self.entries = entries
        self.bucket_bytes = bucket_bytes
        self.peak_bucket_bytes = 0
        """Largest bucket of gathered full tensors seen so far, in bytes (for tests and logs)."""
        self._plan: list[list[WireEntry]] | None = None
        self._next_bucket = 0

    def metadata(self) -> list[TensorMeta]:
        return [e.meta for e in self.entries]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for one sync."""
        return sum(e.meta.nbytes for e in self.entries)

    @torch.no_grad()
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Gathered buckets of `(name, tensor)`; a bucket is gathered only when the previous one was taken."""
        if self._plan is None:
            self._plan = plan_buckets(self.entries, self.bucket_bytes)
        while self._next_bucket < len(self._plan):
            bucket = self._plan[self._next_bucket]
            self._next_bucket += 1
            fulls = [[full_tensor(p) for p in entry.sources] for entry in bucket]
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, sum(t.nbytes for f in fulls for t in f))
            yield [_wire_tensor(entry, full) for entry, full in zip(bucket, fulls, strict=True)]
            del fulls

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    def drain(self) -> None:
        """Take part in every gather not yet run, without using the tensors (non-sending ranks, and the
        sending rank after a failure)."""
        for _ in self.buckets():
            pass


def _wire_tensor(entry: WireEntry, fulls: list[torch.Tensor]) -> tuple[str, torch.Tensor]:
    tensor = entry.combine(fulls) if entry.combine is not None else fulls[0]
    if tensor.dtype != entry.meta.dtype:
        tensor = tensor.to(entry.meta.dtype)
    return entry.meta.name, tensor
