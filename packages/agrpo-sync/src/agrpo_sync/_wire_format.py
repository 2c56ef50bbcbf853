"""The wire format of the server's `nccl` weight transfer in packed mode: metadata and chunk boundaries.

Owns `TensorMeta` (name, dtype, shape: what goes over HTTP in `/update_weights`), the chunk plan
(which tensors travel together in one packed uint8 chunk over NCCL) and packing/unpacking of one chunk.
Does not know NCCL, HTTP or models.

The rule both sides compute independently (vLLM `packed_tensor.py`, 0.32 and 0.33 alike): walk the
tensors in `names` order, append each one's bytes to the current chunk, and close the chunk as soon as
its byte total is greater than `packed_buffer_size_bytes` (so a chunk may exceed the limit by one
tensor, and a tensor larger than the limit is a chunk of its own or ends one); the last partial chunk
is sent too. A tensor's bytes are `contiguous().view(-1).view(uint8)`; the receiver sizes them as
`prod(shape) * itemsize`. Any disagreement splits the byte stream differently on the two sides, so
the sender checks every tensor against the metadata it announced (`chunk_tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ._exceptions import TransportError


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor as announced to the server: checkpoint name, wire dtype, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """The name the worker resolves with `getattr(torch, name)`, e.g. `bfloat16`."""
        return str(self.dtype).split(".")[-1]


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Tensors `metas[start:stop]` travel as one packed chunk of `nbytes` bytes."""

    start: int
    stop: int
    nbytes: int


def plan_chunks(metas: list[TensorMeta], buffer_size_bytes: int) -> list[ChunkPlan]:
    """The chunk boundaries vLLM's sender and receiver both derive from `metas` and the buffer size."""
    plans, start, total = [], 0, 0
    for index, meta in enumerate(metas):
        total += meta.nbytes
        if total > buffer_size_bytes:
            plans.append(ChunkPlan(start=start, stop=index + 1, nbytes=total))
            start, total = index + 1, 0
    if start < len(metas):
        plans.append(ChunkPlan(start=start, stop=len(metas), nbytes=total))
    return plans


def update_info(metas: list[TensorMeta]) -> dict[str, list]:
    """The `/update_weights` body's `update_info`: full lists, as both 0.32 and 0.33 accept."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype_name for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only when it is not contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def pack_chunk(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One packed chunk: the tensors' bytes back to back, in order, as one uint8 tensor."""
    return torch.cat([tensor_bytes(t) for t in tensors])


def unpack_chunk(chunk: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The receiver's view of one chunk: `(name, tensor)` views into `chunk`, shaped by `metas`."""
    sizes = [m.nbytes for m in metas]
    if chunk.numel() != sum(sizes):
        raise TransportError(f"chunk has {chunk.numel()} bytes, metadata announces {sum(sizes)}")
    parts = chunk.split(sizes)
    return [
        (m.name, _aligned(part, m.dtype).view(m.dtype).view(m.shape))
        for m, part in zip(metas, parts, strict=True)
    ]


def _aligned(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view when the bytes sit at an offset `dtype` can be read from, else a copy (odd-sized neighbours)."""
    return part if part.storage_offset() % dtype.itemsize == 0 else part.clone()


def _check(meta: TensorMeta, name: str, tensor: torch.Tensor) -> None:
    if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
        raise TransportError(
            f"the weight stream yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} where the announced "
            f"metadata has {meta.name!r} {meta.dtype} {meta.shape}; the model changed during the sync"
        )


def chunk_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta], plans: list[ChunkPlan]
) -> Iterator[list[torch.Tensor]]:
    """Group a `(name, tensor)` stream into the planned chunks, checking each tensor against `metas`."""
    stream = iter(pairs)
    for plan in plans:
        tensors = []
        for meta in metas[plan.start : plan.stop]:
            item = next(stream, None)
            if item is None:
                raise TransportError(f"the weight stream ended before {meta.name!r}, which was announced")
            _check(meta, *item)
            tensors.append(item[1])
        yield tensors
    extra = next(stream, None)
    if extra is not None:
        raise TransportError(f"the weight stream yielded {extra[0]!r} after every announced tensor")
