"""`WeightSync`: what the trainer calls every `weight_sync_steps` to push its policy to the vLLM server.

Owns one sync from the trainer's side: pause generation (mode `keep` by default), line the trainer
ranks up, send through the chosen backend (only rank 0 talks to the server; every rank joins the
bucketed FSDP2 gather), resume, and time the parts as `perf/weight_sync_s`, `_pause_s`, `_barrier_s`,
`_transfer_s`. Also owns choosing the backend at start-up (full weights over `nccl` or `disk`; for a
PEFT model, adapter-only when the server can serve it and `lora_sync` allows, merged otherwise) and the
start-up checks. Does not know the wire format, HTTP details or how each backend moves bytes.

Failures are loud and safe, and generation resumes only on weights known to be one version. When a
send fails, the backend restores the last good version where it can (`Recovery`). If it could not but
the server still answers (NCCL chunks went out, then the server failed), every weight is sent once more
within the same sync (every rank joins the new gathers) and, on success, the sync returns normally with
`perf/weight_sync_retries` = 1 after a warning naming the first failure. Otherwise every rank raises
`TransferFailedError` saying what happened and what the server serves; if its weights may mix two
versions, generation stays paused and the error says how to resume (sync again, or restart the server).
Rank 0 shares each outcome, so no rank waits forever on the others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._backend import Recovery, SyncBackend
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


@dataclass(frozen=True, kw_only=True)
class _Failure:
    """One failed attempt as rank 0 saw it (shared with every rank): what failed and what it left behind."""

    message: str
    recovery: Recovery


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
    retries: int = 0
    """Complete re-sends after a failed attempt left the server's weights mixed (0 or 1)."""

    def metrics(self) -> dict[str, float]:
        return {
            "perf/weight_sync_s": self.weight_sync_s,
            "perf/weight_sync_pause_s": self.pause_s,
            "perf/weight_sync_barrier_s": self.barrier_s,
            "perf/weight_sync_transfer_s": self.transfer_s,
            "perf/weight_sync_retries": float(self.retries),
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
        self._bytes_sent = 0
        self._peak_gather_bytes = 0

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
        stream = self.param_stream(model)  # walking the parameters happens before generation pauses
        paused, failure = self._pause()
        paused_at = lined_up_at = time.perf_counter()
        resume = paused  # until something is sent, the server holds the last good version
        try:
            if self.world_size > 1:
                dist.barrier()
            lined_up_at = time.perf_counter()
            resume = False  # from here on, only weights known to be one version are served
            failure, retries = self._transfer(model, stream, version, failure)
            resume = paused and (failure is None or failure.recovery.consistent)
            sent_at = time.perf_counter()
        except BaseException as error:
            if paused and not resume:
                error.add_note(
                    f"agrpo-sync left the server paused: its weights may mix two versions. Call sync() again, "
                    f"or restart the server (POST {self.config.base_url}/resume resumes it as it is)"
                )
            raise
        finally:
            if resume:
                self.control.resume()
        if failure is not None:
            raise self._error(failure, version)
        return SyncTimings(
            weight_sync_s=time.perf_counter() - begin,
            pause_s=paused_at - begin,
            barrier_s=lined_up_at - paused_at,
            transfer_s=sent_at - lined_up_at,
            num_bytes=self._bytes_sent,
            peak_gather_bytes=self._peak_gather_bytes,
            retries=retries,
        )

    def _transfer(
        self, model: torch.nn.Module, stream: ParamStream, version: int, failure: _Failure | None
    ) -> tuple[_Failure | None, int]:
        """Send (every rank joins the gathers); once more if the first attempt left the server mixed but
        answering. Returns the shared outcome and the number of re-sends."""
        self._bytes_sent, self._peak_gather_bytes = 0, 0
        failure = self._share(self._attempt(stream, version, failure), self.world_size)
        if failure is None or not failure.recovery.resend:
            return failure, 0
        if self.is_sender:
            logger.warning(
                "weight sync to version %d failed: %s; %s; re-joining and re-sending every weight once",
                version,
                failure.message,
                failure.recovery.state,
            )
        retry = self._share(self._attempt(self.param_stream(model), version, None), self.world_size)
        if retry is None:
            return None, 1
        return _Failure(
            message=f"{failure.message}; the retry failed too: {retry.message}", recovery=retry.recovery
        ), 1

    def _attempt(self, stream: ParamStream, version: int, failure: _Failure | None) -> _Failure | None:
        """One pass over a fresh stream: rank 0 sends it (unless `failure` already stopped it), others drain."""
        if self.is_sender and failure is None:
            failure = self._send(stream, version)
            self._bytes_sent = stream.nbytes
        else:
            stream.drain()
        self._peak_gather_bytes = max(self._peak_gather_bytes, stream.peak_bucket_bytes)
        return failure

    def _error(self, failure: _Failure, version: int) -> TransferFailedError:
        """The error every rank raises; says how to resume when generation stays paused."""
        recovery = failure.recovery
        held = BACKENDS[self.backend_name].pauses and not recovery.consistent
        state = recovery.state
        if held:
            state += (
                f"; generation stays paused so that mixed weights are not served. To resume: {recovery.fix} "
                f"(POST {self.config.base_url}/resume resumes it as it is, mixed weights included)"
            )
        return TransferFailedError(
            f"weight sync to version {version} failed: {failure.message}",
            server_state=state,
            left_paused=held,
        )

    def _pause(self) -> tuple[bool, _Failure | None]:
        """Pause generation if this rank sends and the backend needs it: (paused, failure)."""
        if not (self.is_sender and BACKENDS[self.backend_name].pauses):
            return False, None
        try:
            self.control.pause(self.config.pause_mode, self.config.pause_clear_cache)
        except ServerRequestError as error:
            state = "nothing was sent; the server serves the last good version"
            return False, _Failure(message=f"pause failed: {error}", recovery=Recovery(state=state))
        return True, None

    def _send(self, stream: ParamStream, version: int) -> _Failure | None:
        """Send; on failure recover, finish the other ranks' gathers, and say what failed and what is left."""
        try:
            self.backend.send(stream, version)
            return None
        except _TRANSFER_ERRORS as error:
            logger.warning("weight sync to version %d: the transfer failed", version, exc_info=True)
            message = f"{type(error).__name__}: {error}"
        try:
            recovery = self.backend.recover()
        except _TRANSFER_ERRORS as error:
            recovery = Recovery(
                state=f"restoring the last good version failed too ({type(error).__name__}: {error})",
                consistent=False,
                fix="call sync() again (a complete send resumes generation), or restart the server",
            )
        stream.drain()
        return _Failure(message=message, recovery=recovery)

    def served_model(self, version: int) -> str | None:
        """The `model` name requests under `version` use: an adapter name, or None for the base model."""
        return self.backend.served_model(version) if self.backend is not None else None

    def close(self) -> None:
        """Release the backend's server-side state (adapters, NCCL group) and the HTTP clients."""
        if self.backend is not None:
            self.backend.close()
        if self.control is not None:
            self.control.close()
