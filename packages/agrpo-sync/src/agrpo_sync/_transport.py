"""`ChunkTransport`: the byte channel of the NCCL weight transfer, as a small protocol.

Owns the contract between the NCCL backend and whatever moves the bytes: a 128-byte unique id minted by
rank 0, `connect` (join the group and do the one-element float32 SUM all-reduce every vLLM worker
issues right after `ncclCommInitRank`), `broadcast` from rank 0 on one of a few slots (CUDA streams),
waiting on a slot with a way out, and `abort`. Does not know packing, HTTP or models.

Implementations: `NcclTransport` (ctypes on libnccl, the one that speaks to a real server) and, for
CPU tests and benchmark dry runs, a gloo transport in `tools/bench/weight_sync/`. The seam keeps the
protocol flow, packing and failure handling testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

UNIQUE_ID_BYTES = 128


class ChunkTransport(Protocol):
    """Moves packed uint8 chunks from rank 0 to every other rank of one group."""

    def new_unique_id(self) -> bytes:
        """A fresh 128-byte id for `connect` (rank 0 mints it; the server gets it base64-encoded)."""
        ...

    def connect(self, unique_id: bytes, rank: int, world_size: int) -> None:
        """Join the group (blocks until every rank joined) and run the warm-up all-reduce."""
        ...

    def slot(self, index: int) -> AbstractContextManager[None]:
        """Context in which chunk `index % num_slots` is packed and broadcast (a CUDA stream on GPU)."""
        ...

    def broadcast(self, chunk: torch.Tensor) -> None:
        """Enqueue a broadcast of `chunk` from rank 0 (rank 0 sends, the others receive into it)."""
        ...

    def wait_slot(self, index: int, should_stop: Callable[[], bool], timeout_s: float) -> None:
        """Block until the last broadcast on slot `index` completed; raise `TransportError` if
        `should_stop()` turns true or `timeout_s` passes first."""
        ...

    def synchronize(self, should_stop: Callable[[], bool], timeout_s: float) -> None:
        """`wait_slot` for every slot."""
        ...

    def abort(self) -> None:
        """Tear the group down after a failure; pending collectives return. The transport is unusable after."""
        ...

    def close(self) -> None:
        """Release the group after normal use."""
        ...
