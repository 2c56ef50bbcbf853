"""`WeightSync`: what the trainer calls every `weight_sync_steps` to push its policy to the vLLM servers.

Owns one sync from the trainer's side: check what will be sent against the server's manifest (`_manifest.py`;
refused before pausing), stage what can be written before the pause (the disk checkpoint), pick the servers it
goes to (`ServerRoster`: a restarted one is rejoined, one that does not answer is left out), pause generation
(mode `keep` by default), line the trainer ranks up, send through the chosen backend (only rank 0 talks to the
servers; every rank joins the bucketed FSDP2 gather), resume, and time the parts as `perf/weight_sync_s`,
`_stage_s`, `_pause_s`, `_barrier_s`, `_transfer_s`, `_generation_paused_s` (`SyncTimings`). One sync at a
time: a call from a second thread while one runs is refused. Also owns the start-up sequence (backend choice
and checks: `_start_checks.py`). Does not know the wire format, HTTP details or how backends move bytes.

Several servers: a backend that `fans_out` (disk: the checkpoint is written once and every server reloads it,
in parallel; LoRA: the adapter is written once and loaded on each) makes one pass over the weights; NCCL makes
one pass per server (one gather and one broadcast each; every server has its own NCCL group, so a server that
dies cannot stall the others' transfer). A server that stops accepting connections during a sync is left out
of it and the sync goes on; the version counts as served by the servers that got it (`members`), and the
others are rejoined when they answer again.

Failures are loud and safe, and generation resumes only on weights known to be one version. When a send fails,
the backend restores the last good version where it can (`Recovery`). If it could not but the server still
answers (NCCL chunks went out, then the server failed), every weight is sent once more within the same sync
(every rank joins the new gathers) and, on success, the sync returns normally with `perf/weight_sync_retries`
= 1 after a warning naming the first failure. Otherwise every rank raises `TransferFailedError` saying what
happened and what the server serves; if its weights may mix two versions, generation stays paused and the
error says how to resume (sync again, or restart the server). Rank 0 shares each outcome, so no rank waits
forever on the others; each phase is journaled before it starts, for a kill (`_sync_journal.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._backend import Recovery, SyncBackend
from ._config import WeightSyncConfig
from ._exceptions import ManifestMismatchError, TransferFailedError, WeightSyncError
from ._lora_weights import adapter_entries, has_lora, merged_entries
from ._manifest import Manifest
from ._param_stream import ParamStream, plain_entries
from ._registry import BACKENDS
from ._server_control import ServerControl
from ._server_roster import ServerRoster
from ._start_checks import start_sender
from ._sync_journal import JOURNAL_NAME, SyncJournal
from ._sync_timings import SyncTimings
from ._transport import ChunkTransport

logger = logging.getLogger("agrpo_sync")

# What a failed transfer can raise (torch errors, including CUDA OOM, are RuntimeErrors; I/O is OSError).
_TRANSFER_ERRORS = (RuntimeError, OSError, ValueError)


@dataclass(frozen=True, kw_only=True)
class _Failure:
    """One failed attempt as rank 0 saw it (shared with every rank): what failed and what it left behind."""

    message: str
    recovery: Recovery


def _ranks() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class WeightSync:
    """Pushes the trainer's weights to its vLLM servers; build it with `WeightSync.start`."""

    def __init__(
        self,
        *,
        config: WeightSyncConfig,
        backend_name: str,
        backend: SyncBackend | None,
        controls: list[ServerControl],
        rank: int,
        world_size: int,
    ) -> None:
        self.config = config
        self.backend_name = backend_name
        self.backend = backend
        """Set on the sending rank (0) only."""
        self.controls = controls
        """One per server, on the sending rank (empty elsewhere)."""
        self.roster = ServerRoster(controls)
        self.rank, self.world_size = rank, world_size
        self._bytes_sent = self._peak_gather_bytes = 0
        self.kept: frozenset[str] = (
            frozenset()
        )  # left out of full syncs: the servers keep their own (_start_checks)
        self.manifest: Manifest | None = None
        """What the server holds, to check each sync against (rank 0): its `/weight_info`, else the first sync."""
        self._lock = threading.Lock()
        self._running: int | None = None
        self.journal = SyncJournal(Path(config.output_dir).resolve() / JOURNAL_NAME)  # for a killed trainer

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    @property
    def control(self) -> ServerControl | None:
        """The first server's control (the only one with one server); None on the other ranks."""
        return self.controls[0] if self.controls else None

    @classmethod
    def start(
        cls,
        config: WeightSyncConfig,
        model: torch.nn.Module,
        *,
        transport: ChunkTransport | Callable[[], ChunkTransport] | None = None,
    ):
        """Check the servers, choose the backend, and do its one-time setup (e.g. the NCCL rendezvous). Call on
        every trainer rank. `transport` replaces the NCCL transport (tests use a gloo one); with several servers,
        pass a callable that makes one per server."""
        rank, world_size = _ranks()
        if rank != 0:
            name, kept = cls._share((None, frozenset()), world_size)
            if name is None:
                raise WeightSyncError("rank 0 could not start the weight sync; its error says why")
            follower = cls(
                config=config, backend_name=name, backend=None, controls=[], rank=rank, world_size=world_size
            )
            follower.kept = kept  # rank 0's: every rank streams the same tensors
            return follower
        sync = None
        try:
            sync = start_sender(cls, config, model, transport, world_size)
        finally:
            cls._share((sync.backend_name, sync.kept) if sync else (None, frozenset()), world_size)
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
            entries = plain_entries(model, dtype, self.config.non_text_modules, self.kept)
        return ParamStream(entries, bucket_bytes=self.config.gather_bucket_bytes)

    def sync(self, model: torch.nn.Module, version: int) -> SyncTimings:
        """Push `model`'s weights as `version`; call on every rank. Raises `TransferFailedError` on failure
        (`ManifestMismatchError` when the tensors differ from the server's, before anything is sent), and
        `WeightSyncError` when another thread's sync is running. A server that does not answer is left out
        (`members` says which serve `version`)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}; use an integer >= 0 (it names a directory and a label)")
        if not self._lock.acquire(blocking=False):
            raise WeightSyncError(
                f"sync(version={version}) was called while sync(version={self._running}) is running on another "
                "thread; WeightSync sends one version at a time: call sync from one thread (the training "
                "loop), or wait for the running call to return"
            )
        try:
            self._running = version
            return self._sync(model, version)
        finally:
            self._running = None
            self._lock.release()

    @property
    def members(self) -> set[int]:
        """Indices (in `base_url`) of the servers that serve the last version pushed (rank 0)."""
        return set(self.roster.members)

    def needs_resync(self, index: int) -> bool:
        """Whether server `index` answers but does not serve the last version pushed (rank 0)."""
        return self.roster.needs_resync(index)

    def _sync(self, model: torch.nn.Module, version: int) -> SyncTimings:
        begin = time.perf_counter()
        stream = self.param_stream(model)  # walking the parameters happens before generation pauses
        self._preflight(stream, version)
        self._stage(stream, version)
        staged_at = time.perf_counter()
        if self.is_sender:
            self.roster.roll(self.backend.rejoin)
        self._note("pausing", version)
        paused, failure = self._pause()
        paused_at = lined_up_at = time.perf_counter()
        resume = bool(paused)  # until something is sent, the servers hold the last good version
        try:
            if self.world_size > 1:
                dist.barrier()
            lined_up_at = time.perf_counter()
            self._note("sending", version)
            resume = False  # from here on, only weights known to be one version are served
            failure, retries = self._transfer(model, stream, version, failure)
            resume = bool(paused) and (failure is None or failure.recovery.consistent)
            self._note("sent" if failure is None else "sending", version)
            sent_at = time.perf_counter()
        except BaseException as error:
            if paused and not resume:
                error.add_note(
                    "agrpo-sync left the server paused: its weights may mix two versions. Call sync() again "
                    "(a complete sync resumes generation), or restart the server"
                )
            raise
        finally:
            if resume:
                self.roster.resume(paused)
            if resume or not paused:
                self.journal.clear()
        if failure is not None:
            raise self._error(failure, version)
        if self.is_sender:
            self.roster.served(version)
        if self.manifest is None or not self.manifest.complete:
            self.manifest = Manifest.of(stream.metadata(), f"the first sync (version {version})")
        end = time.perf_counter()
        return SyncTimings(
            weight_sync_s=end - begin,
            stage_s=staged_at - begin,
            pause_s=paused_at - staged_at,
            barrier_s=lined_up_at - paused_at,
            transfer_s=sent_at - lined_up_at,
            generation_paused_s=end - staged_at if paused else 0.0,
            num_bytes=self._bytes_sent,
            peak_gather_bytes=self._peak_gather_bytes,
            retries=retries,
        )

    def _note(self, phase: str, version: int) -> None:
        """Record the phase before acting on it (sender, pausing backends): what a kill from here on leaves."""
        if self.is_sender and BACKENDS[self.backend_name].pauses:
            servers = [self.controls[i].base_url for i in self.roster.targets]
            self.journal.note(
                phase, version, self.backend_name, servers, getattr(self.backend, "staged_dir", None)
            )

    def _preflight(self, stream: ParamStream, version: int) -> None:
        """Refuse, on every rank and before anything is paused or sent, tensors that differ from the manifest."""
        problems = []
        if self.is_sender and self.manifest is not None:
            problems = self.manifest.problems(Manifest.of(stream.metadata(), "this sync"))
        problems = self._share(problems, self.world_size)
        if problems:
            raise ManifestMismatchError(
                f"weight sync to version {version} refused: the tensors to send differ from "
                f"{self.manifest.source if self.manifest else 'the server'}'s: " + "; ".join(problems),
                problems=problems,
                server_state="nothing was sent and generation was not paused; the server serves the last good "
                "version. Send the same parameter names and shapes as the served model (a missing tensor would "
                "be served from the old version, mixing two)",
            )

    def _stage(self, stream: ParamStream, version: int) -> None:
        """Let the backend write ahead, before the pause (every rank joins the gathers); raise on failure."""
        if not BACKENDS[self.backend_name].stages:
            return
        message = None
        if self.is_sender:
            try:
                self.backend.stage(stream, version)
            except _TRANSFER_ERRORS as error:
                message = f"{type(error).__name__}: {error}"
        stream.drain()
        message = self._share(message, self.world_size)
        if message is not None:
            raise TransferFailedError(
                f"weight sync to version {version} failed before pausing: {message}",
                server_state="nothing reached the server: it serves the last good version and generation was "
                "not paused (no partial checkpoint was left behind)",
            )

    def _transfer(
        self, model: torch.nn.Module, stream: ParamStream, version: int, failure: _Failure | None
    ) -> tuple[_Failure | None, int]:
        """Send, pass by pass: one pass reaches every target of a backend that fans out, NCCL makes one per
        server (every rank joins each pass's gathers). Returns the shared outcome and the number of re-sends."""
        self._bytes_sent, self._peak_gather_bytes = 0, 0
        targets = self.roster.targets if self.is_sender else []
        groups = [targets] if BACKENDS[self.backend_name].fans_out else [[i] for i in targets]
        retries = 0
        for index in range(self._share(len(groups), self.world_size)):
            pass_stream = stream if index == 0 else self.param_stream(model)
            group = groups[index] if self.is_sender else []
            failure, again = self._pass(model, pass_stream, version, failure, group)
            retries += again
            if failure is not None:
                break
        return failure, retries

    def _pass(
        self,
        model: torch.nn.Module,
        stream: ParamStream,
        version: int,
        failure: _Failure | None,
        group: list[int],
    ) -> tuple[_Failure | None, int]:
        """One pass, and once more if the first attempt left its servers mixed but answering."""
        failure = self._share(self._attempt(stream, version, failure, group), self.world_size)
        if failure is None or not failure.recovery.resend:
            return failure, 0
        if self.is_sender:
            logger.warning(
                "weight sync to version %d failed: %s; %s; re-joining and re-sending every weight once",
                version,
                failure.message,
                failure.recovery.state,
            )
        retry = self._share(self._attempt(self.param_stream(model), version, None, group), self.world_size)
        if retry is None:
            return None, 1
        return _Failure(
            message=f"{failure.message}; the retry failed too: {retry.message}", recovery=retry.recovery
        ), 1

    def _attempt(
        self, stream: ParamStream, version: int, failure: _Failure | None, group: list[int]
    ) -> _Failure | None:
        """One pass over a fresh stream: rank 0 sends it (unless `failure` already stopped it), others drain."""
        if self.is_sender and failure is None:
            failure = self._send(stream, version, group)
            self._bytes_sent += stream.nbytes
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
                f"; generation stays paused so that mixed weights are not served. To resume: {recovery.fix}"
            )
            if recovery.resume_as_is:
                urls = " and ".join(f"{url}/resume" for url in self.config.server_urls)
                state += f" (POST {urls} resumes it as it is, mixed weights included)"
        message = f"weight sync to version {version} failed: {failure.message}"
        return TransferFailedError(message, server_state=state, left_paused=held)

    def _pause(self) -> tuple[list[int], _Failure | None]:
        """Pause generation on every target if this rank sends and the backend needs it: (paused, failure)."""
        if not (self.is_sender and BACKENDS[self.backend_name].pauses):
            return [], None
        paused, refusal = self.roster.pause(self.config.pause_mode, self.config.pause_clear_cache)
        if refusal is None:
            return paused, None
        state = "nothing was sent; the server serves the last good version"
        return [], _Failure(message=f"pause failed: {refusal}", recovery=Recovery(state=state))

    def _send(self, stream: ParamStream, version: int, group: list[int]) -> _Failure | None:
        """Send; on failure recover, finish the other ranks' gathers, and say what failed and what is left."""
        try:
            for index in self.backend.send(stream, version, group):
                self.roster.lose(index, f"it stopped answering during the sync to version {version}")
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
        for control in self.controls:
            control.close()
