"""`NcclBackend`: full weights over the server's `nccl` weight-transfer protocol, without importing vLLM.

Owns the protocol sequence on the trainer side (rank 0 of the NCCL group):
  once:      GET /get_world_size -> W; mint a unique id; POST /init_weight_transfer_engine with
             {nccl_unique_id_b64, rank_offset: 1, world_size: 1+W, packed: true, packed_buffer_size_bytes,
             packed_num_buffers} on a background thread while joining the group and doing the warm-up
             all-reduce here; both must succeed.
  each sync: POST /start_weight_update; POST /update_weights {names, dtype_names, shapes} on a background
             thread while broadcasting the packed chunks; POST /finish_weight_update {weight_version}.
and what a failure leaves behind. Does not know pausing or ranks (`WeightSync`), the wire format
(`_wire_format.py`) or NCCL itself (`ChunkTransport`).

Failures (`recover`): if the server rejects the update before any chunk was broadcast,
`finish_weight_update` puts every layer's old tensors back (vLLM's layerwise reload restores layers
that received nothing), so the server serves the last good version. Once chunks have been broadcast,
the layers they carried are already replaced: the group is aborted, the update is finished without a
version label, and the server's layers mix two versions (`mixed`) until a complete send; `recover`
says so with `resend=True`, and `WeightSync` re-sends at once (the next `send` re-joins with a fresh
unique id). A server whose `/update_weights` never answered may be stuck inside NCCL: only a restart
clears it, and `recover` says so. Each `send` is bounded as a whole by `transfer_timeout_s`.

Several servers: one NCCL group per server (`NcclLink`), and `WeightSync` makes one pass per server (one
gather, one broadcast each; `fans_out` is False). One group spanning every server would send the bytes
once, but it couples them: a server that dies mid-broadcast stalls the others inside NCCL until they are
restarted. A server that restarted is rejoined with a new rendezvous (`rejoin`: the trainer's half of the
old group is aborted and the next send joins a fresh one; a restarted process has no group to shut down),
and one that stops answering during its send is reported lost (its group aborted) while the others go on.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import ClassVar

import torch

from ._backend import Recovery
from ._background_call import BackgroundCall
from ._config import WeightSyncConfig
from ._exceptions import ServerRequestError, ServerUnreachableError, SyncSetupError, TransportError
from ._nccl_transport import NcclTransport
from ._param_stream import ParamStream
from ._server_control import ServerControl, ServerInfo
from ._transport import ChunkTransport
from ._wire_format import ChunkPlan, TensorMeta, chunk_tensors, pack_chunk, plan_chunks, update_info


def _wait_both(server: BackgroundCall, local: BackgroundCall, timeout_s: float) -> None:
    """Wait for both halves of a rendezvous; the first failure wins (the other half may never return)."""
    deadline = time.monotonic() + timeout_s
    while not (server.done() and local.done()):
        if server.failed():
            server.wait(0)
        if local.failed():
            local.wait(0)
        if time.monotonic() > deadline:
            raise TransportError(f"NCCL rendezvous with the server did not complete within {timeout_s:.0f} s")
        server.join(0.01)
    server.wait(0)
    local.wait(0)


RESEND_FIX = (
    "call sync() again (it re-joins NCCL, re-sends every weight and resumes generation once all arrived), "
    "or restart the server"
)


class NcclLink:
    """Sends full weights as packed uint8 chunks over NCCL to every worker of one vLLM server."""

    def __init__(
        self, *, control: ServerControl, transport: ChunkTransport, config: WeightSyncConfig
    ) -> None:
        self.control = control
        self.transport = transport
        self.buffer_size_bytes = config.packed_buffer_size_bytes
        self.num_buffers = config.packed_num_buffers
        self.timeout_s = config.transfer_timeout_s
        self.connected = False
        self.mixed = False
        """True while the server's layers may mix two versions: chunks went out in a failed attempt and no
        complete send has finished since."""
        self.chunks_sent = 0
        self.num_chunks = 0
        self._started = False
        self._fresh_server = False
        """The server restarted: it has no group to shut down before the next rendezvous."""
        self._update: BackgroundCall | None = None
        self._deadline: float | None = None

    def connect(self) -> None:
        """Join the server's NCCL group as rank 0 (the server's half runs on a background thread)."""
        world_size = 1 + self.control.world_size()
        unique_id = self.transport.new_unique_id()
        init_info = {
            "nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
            "rank_offset": 1,
            "world_size": world_size,
            "packed": True,
            "packed_buffer_size_bytes": self.buffer_size_bytes,
            "packed_num_buffers": self.num_buffers,
        }
        server = BackgroundCall(
            self.control.init_weight_transfer, init_info, name="agrpo-sync-nccl-init"
        ).start()
        local = BackgroundCall(
            self.transport.connect, unique_id, 0, world_size, name="agrpo-sync-nccl-join"
        ).start()
        try:
            _wait_both(server, local, self._remaining())
        except ServerRequestError as error:
            raise TransportError(
                f"the server did not join the NCCL group ({error}); it needs a GPU, VLLM_SERVER_DEV_MODE=1 and "
                """--weight-transfer-config '{"backend":"nccl"}' (or set backend="disk")"""
            ) from error
        self.connected = True

    def _remaining(self) -> float:
        """Seconds left of the current send's `transfer_timeout_s` (all of it outside a send)."""
        if self._deadline is None:
            return self.timeout_s
        return max(0.0, self._deadline - time.monotonic())

    def send(self, stream: ParamStream, version: int) -> None:
        metas = stream.metadata()
        plans = plan_chunks(metas, self.buffer_size_bytes)
        self.chunks_sent, self.num_chunks, self._update = 0, len(plans), None
        self._deadline = time.monotonic() + self.timeout_s
        if not self.connected and self._fresh_server:
            self.connect()
            self._fresh_server = False
        elif not self.connected:
            self._reconnect()
        self.control.start_weight_update()
        self._started = True
        self._update = BackgroundCall(
            self.control.update_weights, update_info(metas), name="agrpo-sync-update"
        )
        self._update.start()
        try:
            self._broadcast(stream, metas, plans, self._update)
            self.transport.synchronize(self._update.failed, self._remaining())
        except RuntimeError:
            if self._update.join(1.0) and self._update.failed():
                self._update.wait(0)  # the server's own error says more than the transport's
            raise
        self._update.wait(self._remaining())
        self.control.finish_weight_update(str(version))
        self._started = False
        self.mixed = False

    def _broadcast(
        self, stream: ParamStream, metas: list[TensorMeta], plans: list[ChunkPlan], update: BackgroundCall
    ) -> None:
        in_flight: list[object] = [None] * self.num_buffers
        for index, tensors in enumerate(chunk_tensors(stream, metas, plans)):
            slot = index % self.num_buffers
            self.transport.wait_slot(slot, update.failed, self._remaining())
            in_flight[slot] = None  # the chunk that used this slot has landed; free it
            if update.failed():
                update.wait(0)
            with self.transport.slot(slot):
                chunk = pack_chunk(tensors)
                self.chunks_sent += 1  # counted once attempted: a failed broadcast leaves the group suspect
                self.transport.broadcast(chunk)
            in_flight[slot] = (chunk, tensors)

    def rejoin(self) -> None:
        """The server restarted (or was left out): drop the trainer's half of the old group; the next send
        joins a fresh one. A same process that missed syncs still has its half: shut it down first."""
        if self.connected:
            self.transport.abort()
            self.connected = False
        self._started, self.mixed = False, False
        try:
            self.control.shutdown_weight_transfer()
        except ServerUnreachableError:
            raise
        except ServerRequestError:  # a restarted process has no group to shut down
            pass
        self._fresh_server = True

    def drop(self) -> None:
        """The server stopped answering mid-send: abort the group (it is rejoined once the server answers)."""
        self.transport.abort()
        self.connected, self._started = False, False

    def _reconnect(self) -> None:
        """After a failed transfer: drop the server's half of the old group, then join a fresh one."""
        self.control.shutdown_weight_transfer()
        self.connect()

    def _finish_unlabelled(self) -> None:
        """End an open update without a version label (the server restores layers that received nothing)."""
        if self._started:
            self.control.finish_weight_update(None)
            self._started = False

    def _update_answered(self) -> bool:
        """Whether the server answered `/update_weights` (any status): then it is not stuck inside NCCL. A
        client-side timeout or a dropped connection is no answer."""
        if self._update is None:
            return True
        error = self._update.error
        return self._update.done() and not (isinstance(error, ServerRequestError) and error.status is None)

    def recover(self) -> Recovery:
        update_done = self._update_answered()
        if self.chunks_sent == 0 and update_done:  # neither side entered a collective: the group is intact
            self._finish_unlabelled()
            if not self.mixed:
                return Recovery(state="the server serves the last good version (no weight had been sent)")
            return Recovery(
                state="no weight was sent, and an earlier failed attempt left the server's layers mixing two versions",
                consistent=False,
                resend=True,
                fix=RESEND_FIX,
                resume_as_is=True,
            )
        self.transport.abort()
        self.connected = False
        self.mixed = True
        sent = f"{self.chunks_sent} of {self.num_chunks} chunks were sent"
        if not update_done:
            return Recovery(
                state=f"{sent} and the server has not answered /update_weights: it may be blocked inside NCCL, "
                "and its layers may mix the last good and the new version",
                consistent=False,
                fix="restart the server (one blocked inside NCCL answers neither a new sync nor /resume)",
            )
        self._finish_unlabelled()
        return Recovery(
            state=f"{sent} before the failure, so the server's layers mix the last good and the new version",
            consistent=False,
            resend=True,
            fix=RESEND_FIX,
            resume_as_is=True,
        )

    def close(self) -> None:
        if self.connected:
            self.transport.close()
            self.control.shutdown_weight_transfer()
            self.connected = False


class NcclBackend:
    """One `NcclLink` per server; each `send` goes to one of them (`WeightSync` makes one pass per server)."""

    name: ClassVar[str] = "nccl"
    pauses: ClassVar[bool] = True
    view: ClassVar[str] = "full"
    stages: ClassVar[bool] = False
    fans_out: ClassVar[bool] = False

    def __init__(self, links: list[NcclLink]) -> None:
        self.links = links
        self._active = 0

    @property
    def link(self) -> NcclLink:
        """The link of the last send (the only one with one server)."""
        return self.links[self._active]

    @classmethod
    def from_config(
        cls,
        config: WeightSyncConfig,
        controls: list[ServerControl],
        transport: ChunkTransport | Callable[[], ChunkTransport] | None,
    ):
        if transport is not None and not callable(transport) and len(controls) > 1:
            raise SyncSetupError(
                "one transport was given for several servers; pass a callable that makes one per server"
            )

        def make() -> ChunkTransport:
            if transport is None:
                return NcclTransport(
                    library_path=config.nccl_library,
                    device_index=config.device_index,
                    num_slots=config.packed_num_buffers,
                )
            return transport() if callable(transport) else transport

        return cls([NcclLink(control=control, transport=make(), config=config) for control in controls])

    def stage(self, stream: ParamStream, version: int) -> None:
        """Nothing to write ahead: the chunks are gathered and broadcast during the pause."""

    def setup(self, model: torch.nn.Module, stream: ParamStream, infos: list[ServerInfo]) -> None:
        for link in self.links:
            link.connect()

    def send(self, stream: ParamStream, version: int, targets: list[int]) -> set[int]:
        """Broadcast to the one server of this pass; a server that stopped answering is reported lost."""
        (self._active,) = targets
        try:
            self.link.send(stream, version)
        except ServerUnreachableError:
            self.link.drop()
            stream.drain()
            return {self._active}
        return set()

    def rejoin(self, index: int) -> None:
        self.links[index].rejoin()

    def recover(self) -> Recovery:
        return self.link.recover()

    def served_model(self, version: int) -> str | None:
        return None

    def close(self) -> None:
        for link in self.links:
            link.close()
