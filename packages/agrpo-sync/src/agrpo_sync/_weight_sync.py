"""`WeightSync`: what the trainer calls every `weight_sync_steps` to push its policy to the vLLM server.

Owns one sync from the trainer's side: pause generation (mode `keep` by default), line the trainer
ranks up, send through the chosen backend (only rank 0 talks to the server; every rank joins the
bucketed FSDP2 gather), resume, and time the parts as `perf/weight_sync_s`, `_pause_s`, `_barrier_s`,
`_transfer_s`. Also owns choosing the backend at start-up (full weights over `nccl` or `disk`; for a
PEFT model, adapter-only when the server can serve it and `lora_sync` allows, merged otherwise) and the
start-up checks. Does not know the wire format, HTTP details or how each backend moves bytes.

Failures are loud and safe: whatever fails during a sync, the backend restores the last good version
where it can, generation is resumed, and every rank raises `TransferFailedError` saying what happened
and what the server serves now (rank 0 shares the outcome, so no rank waits forever on the others).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._backend import SyncBackend
from ._config import WeightSyncConfig
from ._exceptions import ServerRequestError, SyncSetupError, TransferFailedError, WeightSyncError
from ._lora_backend import adapter_problems, check_adapter_server, lora_config_of
from ._lora_weights import adapter_entries, has_lora, merged_entries
from ._param_stream import ParamStream, plain_entries
from ._registry import BACKENDS
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport

logger = logging.getLogger("agrpo_sync")

# What a failed transfer can raise (torch errors, including CUDA OOM, are RuntimeErrors; I/O is OSError).
_TRANSFER_ERRORS = (RuntimeError, OSError, ValueError)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncTimings:
    """Wall-clock parts of one sync on the calling rank, in seconds."""

    weight_sync_s: float
    """Everything the trainer waits for: pause, barrier, transfer, resume."""
    pause_s: float
    barrier_s: float
    transfer_s: float
    """Gather, send, and the server loading the weights (its `finish` or reload included)."""
    num_bytes: int
    """Bytes sent (0 on ranks that only joined the gather)."""
    peak_gather_bytes: int
    """Largest bucket of full tensors this rank held at once, in bytes (bounded by `gather_bucket_bytes`
    unless one tensor is larger)."""

    def metrics(self) -> dict[str, float]:
        return {
            "perf/weight_sync_s": self.weight_sync_s,
            "perf/weight_sync_pause_s": self.pause_s,
            "perf/weight_sync_barrier_s": self.barrier_s,
            "perf/weight_sync_transfer_s": self.transfer_s,
        }


def _ranks() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def choose_backend(config: WeightSyncConfig, model: torch.nn.Module, info: ServerInfo) -> str:
    """`lora` for adapter-only sync of a PEFT model when allowed and possible, else `config.backend`."""
    if not has_lora(model) or config.lora_sync == "merged":
        return config.backend
    lora_config = lora_config_of(model)
    if config.lora_sync == "adapter":
        check_adapter_server(info, lora_config, config.max_staleness)
        return "lora"
    problems = adapter_problems(info, lora_config, config.max_staleness)
    if problems:
        logger.warning(
            "LoRA: pushing merged weights over %s; adapter sync is off: %s",
            config.backend,
            "; ".join(problems),
        )
        return config.backend
    return "lora"


def check_full_sync(
    config: WeightSyncConfig, info: ServerInfo, model: torch.nn.Module, stream: ParamStream
) -> None:
    """Start-up checks of a full-weight sync: the server's transfer flag; warnings for a dtype mismatch and
    for a tied embedding on a CPU server (vLLM 0.32's CPU backend prepacks the tied `lm_head` at load and
    its in-place reload never re-processes it, so embedding updates reach the input side only)."""
    if config.backend == "nccl" and info.weight_transfer_backend != "nccl":
        raise SyncSetupError(
            f"the server's weight transfer backend is {info.weight_transfer_backend!r}; restart it with "
            """VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{"backend":"nccl"}', or set backend="disk\""""
        )
    sent = sorted({m.dtype_name for m in stream.metadata()})
    if info.dtype and sent != [info.dtype]:
        logger.warning(
            "the server runs %s and the trainer sends %s; set transfer_dtype to match", info.dtype, sent
        )


class WeightSync:
    """Pushes the trainer's weights to one vLLM server; build it with `WeightSync.start`."""

    def __init__(
        self,
        *,
        config: WeightSyncConfig,
        backend_name: str,
        backend: SyncBackend | None,
        control: ServerControl | None,
        rank: int,
        world_size: int,
    ) -> None:
        self.config = config
        self.backend_name = backend_name
        self.backend = backend
        """Set on the sending rank (0) only."""
        self.control = control
        self.rank = rank
        self.world_size = world_size

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(
        cls, config: WeightSyncConfig, model: torch.nn.Module, *, transport: ChunkTransport | None = None
    ):
        """Check the server, choose the backend, and do its one-time setup (e.g. the NCCL rendezvous).

        Call on every trainer rank. `transport` replaces the NCCL transport (tests use a gloo one).
        """
        rank, world_size = _ranks()
        if rank != 0:
            name = cls._share(None, world_size)
            if name is None:
                raise WeightSyncError("rank 0 could not start the weight sync; its error says why")
            return cls(
                config=config, backend_name=name, backend=None, control=None, rank=rank, world_size=world_size
            )
        name = None
        try:
            sync = cls._start_sender(config, model, transport, world_size)
            name = sync.backend_name
        finally:
            cls._share(name, world_size)
        return sync

    @classmethod
    def _start_sender(cls, config, model, transport, world_size) -> WeightSync:
        control = ServerControl(
            config.base_url, timeout_s=config.http_timeout_s, transfer_timeout_s=config.transfer_timeout_s
        )
        info = control.server_info()
        name = choose_backend(config, model, info)
        backend = BACKENDS[name].from_config(config, control, transport)
        sync = cls(
            config=config, backend_name=name, backend=backend, control=control, rank=0, world_size=world_size
        )
        stream = sync.param_stream(model)
        if backend.view == "full":
            check_full_sync(config, info, model, stream)
        backend.setup(model, stream, info)
        logger.info(
            "weight sync: %s backend, %d tensors, %.3f GB per sync",
            name,
            len(stream.entries),
            stream.nbytes / 1e9,
        )
        return sync

    @staticmethod
    def _share(value: Any, world_size: int) -> Any:
        """Rank 0's `value` on every rank (a no-op without other ranks)."""
        if world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def param_stream(self, model: torch.nn.Module) -> ParamStream:
        """The tensors this sync sends (the same on every rank, so the gathers line up)."""
        dtype = getattr(torch, self.config.transfer_dtype) if self.config.transfer_dtype else None
        view = BACKENDS[self.backend_name].view
        if view == "adapter":
            entries = adapter_entries(model, dtype)
        elif has_lora(model):
            entries = merged_entries(model, dtype, self.config.non_text_modules)
        else:
            entries = plain_entries(model, dtype, self.config.non_text_modules)
        return ParamStream(entries, bucket_bytes=self.config.gather_bucket_bytes)

    def sync(self, model: torch.nn.Module, version: int) -> SyncTimings:
        """Push `model`'s weights as `version`; call on every rank. Raises `TransferFailedError` on failure."""
        begin = time.perf_counter()
        stream = self.param_stream(model)
        paused, failure = self._pause()
        paused_at = time.perf_counter()
        try:
            if self.world_size > 1:
                dist.barrier()
            lined_up_at = time.perf_counter()
            if self.is_sender and failure is None:
                failure = self._send(stream, version)
            else:
                stream.drain()
            sent_at = time.perf_counter()
        finally:
            if paused:
                self.control.resume()
        failure = self._share(failure, self.world_size)
        if failure is not None:
            message, state = failure
            raise TransferFailedError(
                f"weight sync to version {version} failed: {message}", server_state=state
            )
        return SyncTimings(
            weight_sync_s=time.perf_counter() - begin,
            pause_s=paused_at - begin,
            barrier_s=lined_up_at - paused_at,
            transfer_s=sent_at - lined_up_at,
            num_bytes=stream.nbytes if self.is_sender else 0,
            peak_gather_bytes=stream.peak_bucket_bytes,
        )

    def _pause(self) -> tuple[bool, tuple[str, str] | None]:
        """Pause generation if this rank sends and the backend needs it: (paused, failure)."""
        if not (self.is_sender and BACKENDS[self.backend_name].pauses):
            return False, None
        try:
            self.control.pause(self.config.pause_mode, self.config.pause_clear_cache)
        except ServerRequestError as error:
            return False, (
                f"pause failed: {error}",
                "nothing was sent; the server serves the last good version",
            )
        return True, None

    def _send(self, stream: ParamStream, version: int) -> tuple[str, str] | None:
        """Send; on failure recover, finish the other ranks' gathers, and return (what failed, server state)."""
        try:
            self.backend.send(stream, version)
            return None
        except _TRANSFER_ERRORS as error:
            logger.exception("weight sync to version %d failed", version)
            message = f"{type(error).__name__}: {error}"
        try:
            state = self.backend.recover()
        except _TRANSFER_ERRORS as error:
            state = f"restoring the last good version failed too ({type(error).__name__}: {error})"
        stream.drain()
        return message, state

    def served_model(self, version: int) -> str | None:
        """The `model` name requests under `version` use: an adapter name, or None for the base model."""
        return self.backend.served_model(version) if self.backend is not None else None

    def close(self) -> None:
        """Release the backend's server-side state (adapters, NCCL group) and the HTTP clients."""
        if self.backend is not None:
            self.backend.close()
        if self.control is not None:
            self.control.close()
