"""`GlooTransport`: a CPU stand-in for `agrpo_sync.NcclTransport`, for tests and benchmark dry runs.

Owns a gloo process group built from a 128-byte "unique id" that carries the rank-0 store's address
(magic, IPv4 address, port, random prefix), the warm-up all-reduce, and synchronous broadcasts. It
follows the `ChunkTransport` contract exactly, so the NCCL backend's protocol flow, packing and failure
handling run unchanged on CPU. It cannot talk to a real vLLM server (those only speak NCCL).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import struct
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from agrpo_sync import TransportError

MAGIC = b"AGRPOGLOO"
_LAYOUT = "!9s4sH16s"


class GlooTransport:
    """`ChunkTransport` over gloo on CPU tensors; rank 0 hosts the rendezvous store."""

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: dist.TCPStore | None = None
        self._group = None

    def new_unique_id(self) -> bytes:
        listener = socket.socket(
            socket.AF_INET, socket.SOCK_STREAM
        )  # TCPStore alone listens on every interface
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self._store = dist.TCPStore(
            "127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False, use_libuv=False,
            timeout=self.timeout, master_listen_fd=listener.detach(),
        )  # fmt: skip
        packed = struct.pack(_LAYOUT, MAGIC, socket.inet_aton("127.0.0.1"), self._store.port, os.urandom(16))
        return packed.ljust(128, b"\0")

    def connect(self, unique_id: bytes, rank: int, world_size: int) -> None:
        magic, host, port, prefix = struct.unpack_from(_LAYOUT, unique_id)
        if magic != MAGIC:
            raise TransportError("not a GlooTransport unique id")
        store = self._store if rank == 0 else None
        if store is None:
            store = dist.TCPStore(
                socket.inet_ntoa(host), port, is_master=False, use_libuv=False, timeout=self.timeout
            )
            self._store = store
        options = dist.ProcessGroupGloo._Options()
        options._devices = [
            dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        ]  # pairs on loopback too
        options._timeout = self.timeout
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(prefix.hex(), store), rank, world_size, options)
        self.barrier()

    def barrier(self) -> None:
        """The one-element float32 SUM all-reduce (warm-up, and a meeting point for benchmarks)."""
        self._group.allreduce([torch.zeros(1, dtype=torch.float32)]).wait()

    @contextlib.contextmanager
    def slot(self, index: int) -> Iterator[None]:
        yield

    def broadcast(self, chunk: torch.Tensor) -> None:
        if self._group is None:
            raise TransportError("broadcast before connect (or after abort)")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([chunk], options).wait()

    def wait_slot(self, index: int, should_stop: Callable[[], bool], timeout_s: float) -> None:
        """Broadcasts are synchronous here: nothing is ever in flight."""

    def synchronize(self, should_stop: Callable[[], bool], timeout_s: float) -> None:
        """Broadcasts are synchronous here: nothing is ever in flight."""

    def abort(self) -> None:
        self._group = None

    def close(self) -> None:
        self._group = None
