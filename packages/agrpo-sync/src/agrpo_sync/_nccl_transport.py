"""`NcclTransport`: the NCCL half of the server's weight transfer, through ctypes on libnccl, without vLLM.

Owns loading `libnccl.so.2` (the one of the `nvidia-nccl` wheel CUDA torch depends on, or an explicit
path), the six calls the sender needs (`ncclGetUniqueId`, `ncclCommInitRank`, `ncclAllReduce` for the
warm-up, `ncclBroadcast`, `ncclCommDestroy`, `ncclCommAbort`), and one CUDA stream per slot so packing
chunk i+1 overlaps the broadcast of chunk i. Does not know HTTP, packing or models.

vLLM's workers join the group with a PyNccl communicator built from the same unique id; a
torch.distributed process group cannot join it (different bootstrap), hence raw NCCL. Waits poll CUDA
events (about every 50 us) instead of blocking, so a server that fails mid-transfer turns into an
`ncclCommAbort` and an error, not a hang. GPU only: nothing here runs on CPU-only machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ._exceptions import TransportError
from ._transport import UNIQUE_ID_BYTES

NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0
_POLL_S = 50e-6


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def find_nccl_library(explicit: str = "") -> str:
    """An explicit path; else the libnccl already loaded in this process (CUDA torch loads its own at
    import, and one NCCL per process is safest); else the `nvidia-nccl` wheel's; else the soname."""
    if explicit:
        return explicit
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libnccl.so" in line:
                return line.split()[-1]
    with contextlib.suppress(ImportError):
        import nvidia

        for root in nvidia.__path__:
            for candidate in sorted(Path(root).rglob("libnccl.so*")):
                return str(candidate)
    return "libnccl.so.2"


class NcclLibrary:
    """ctypes bindings of the libnccl calls the sender needs; every failing call raises `TransportError`."""

    def __init__(self, path: str) -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as error:
            raise TransportError(f"cannot load NCCL from {path!r} ({error}); set nccl_library") from error
        lib, p, i, size_t = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(p), i, _UniqueId, i]
        lib.ncclAllReduce.argtypes = [p, p, size_t, i, i, p, p]
        lib.ncclBroadcast.argtypes = [p, p, size_t, i, i, p, p]
        lib.ncclCommDestroy.argtypes = [p]
        lib.ncclCommAbort.argtypes = [p]

    def check(self, result: int, call: str) -> None:
        if result != 0:
            raise TransportError(
                f"{call} failed: {self.lib.ncclGetErrorString(result).decode()} (code {result})"
            )

    def version(self) -> int:
        version = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        return version.value

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, unique_id: bytes, rank: int, world_size: int) -> ctypes.c_void_p:
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm


class NcclTransport:
    """`ChunkTransport` over raw NCCL on one CUDA device, with `num_slots` streams."""

    def __init__(self, *, library_path: str = "", device_index: int = -1, num_slots: int = 2) -> None:
        self.library_path = library_path
        self.device_index = device_index
        self.num_slots = num_slots
        self._library: NcclLibrary | None = None
        self._comm: ctypes.c_void_p | None = None
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event | None] = []
        self._slot = 0
        self._device: torch.device | None = None

    @property
    def library(self) -> NcclLibrary:
        if self._library is None:
            self._library = NcclLibrary(find_nccl_library(self.library_path))
        return self._library

    @property
    def device(self) -> torch.device:
        """`device_index`, or the device current on the thread that first asks (`new_unique_id` runs on the
        caller's thread; `connect` may run on a helper thread, whose current device is always 0)."""
        if self._device is None:
            index = self.device_index if self.device_index >= 0 else torch.cuda.current_device()
            self._device = torch.device("cuda", index)
        return self._device

    def new_unique_id(self) -> bytes:
        library = self.library
        _ = self.device
        return library.unique_id()

    def connect(self, unique_id: bytes, rank: int, world_size: int) -> None:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise TransportError(f"NCCL unique id has {len(unique_id)} bytes, expected {UNIQUE_ID_BYTES}")
        device = self.device
        with torch.cuda.device(device):
            self._comm = self.library.init_rank(unique_id, rank, world_size)
            self.barrier()  # the warm-up every vLLM worker issues right after ncclCommInitRank
            self._streams = [torch.cuda.Stream(device) for _ in range(self.num_slots)]
            self._events = [None] * self.num_slots

    def barrier(self) -> None:
        """A one-element float32 SUM all-reduce on the current stream, waited for: the warm-up handshake,
        and a meeting point for benchmarks."""
        with torch.cuda.device(self.device):
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)
            stream = torch.cuda.current_stream(self.device)
            ptr = ctypes.c_void_p(warm.data_ptr())
            result = self.library.lib.ncclAllReduce(
                ptr, ptr, 1, NCCL_FLOAT32, NCCL_SUM, self._comm, ctypes.c_void_p(stream.cuda_stream)
            )
            self.library.check(result, "ncclAllReduce")
            stream.synchronize()

    @contextlib.contextmanager
    def slot(self, index: int) -> Iterator[None]:
        self._slot = index % self.num_slots
        stream = self._streams[self._slot]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def broadcast(self, chunk: torch.Tensor) -> None:
        if self._comm is None:
            raise TransportError("broadcast before connect (or after abort)")
        stream = torch.cuda.current_stream(chunk.device)
        ptr = ctypes.c_void_p(chunk.data_ptr())
        result = self.library.lib.ncclBroadcast(
            ptr, ptr, chunk.numel(), NCCL_UINT8, 0, self._comm, ctypes.c_void_p(stream.cuda_stream)
        )
        self.library.check(result, "ncclBroadcast")
        event = torch.cuda.Event()
        event.record(stream)
        self._events[self._slot] = event

    def wait_slot(self, index: int, should_stop: Callable[[], bool], timeout_s: float) -> None:
        event = self._events[index % self.num_slots] if self._events else None
        deadline = time.monotonic() + timeout_s
        while event is not None and not event.query():
            if should_stop():
                raise TransportError(
                    "the server side of the transfer stopped while a broadcast was in flight"
                )
            if time.monotonic() > deadline:
                raise TransportError(f"a broadcast did not complete within {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def synchronize(self, should_stop: Callable[[], bool], timeout_s: float) -> None:
        for index in range(len(self._events)):
            self.wait_slot(index, should_stop, timeout_s)

    def abort(self) -> None:
        if self._comm is not None:
            self.library.lib.ncclCommAbort(self._comm)
            self._comm = None

    def close(self) -> None:
        if self._comm is not None:
            self.library.check(self.library.lib.ncclCommDestroy(self._comm), "ncclCommDestroy")
            self._comm = None
