"""`ServerPause`: whether one server's generation is held by `/pause`, asked only while its requests stall.

A vLLM server in dev mode holds every generation request while it is paused (`POST /pause`, which a weight
sync sends and `POST /resume` ends). A trainer killed in the middle of a sync leaves it paused: requests
then wait without an error until `vllm_server_timeout` (default 30 minutes). This object makes that visible
within seconds: it asks `GET /is_paused` (`{"is_paused": bool}`) when the server has generation requests in
flight and none of them has finished for `STALL_S`, at most every `ASK_EVERY_S`, and warns once per pause
episode, naming the server, how long its requests have waited and the fix. Owned by the server's
`PooledServer`, whose `watch` calls `check`, so the rollout loop and the eval CLI (which runs that loop)
both get it. Does not know what a pause is for, nor change what the loop does: a paused server keeps its
groups, which finish once it resumes.

Short pauses stay silent: a trainer's weight sync pauses for well under a second (disk, CPU server) to a
few seconds (NCCL, large models), while requests in flight usually finish every fraction of a second. A
warning needs both requests waiting `WARN_AFTER_S` with none finished and two answers `is_paused: true` in
a row, `ASK_EVERY_S` apart (so the pause lasted at least that long). The cost on a healthy server: one
small GET per `ASK_EVERY_S` while no request finishes (long completions on few requests), none otherwise.
A server without dev mode answers 404: it is not asked again.
"""

from __future__ import annotations

import logging
import time

from ._client import VLLMClient
from ._exceptions import RequestRejectedError, ResponseFormatError, ServerUnavailableError
from ._server import json_body

logger = logging.getLogger("agrpo_rollout")

STALL_S = 5.0
"""Seconds generation requests wait with none finished before the server is asked whether it is paused."""
ASK_EVERY_S = 5.0
"""Seconds between two `GET /is_paused` of one server."""
WARN_AFTER_S = 10.0
"""Seconds requests wait with none finished, the server paused, before the warning."""
_ASK_TIMEOUT_S = 5.0


class ServerPause:
    """One server's pause episodes: `check()` from its watch; `held_s` for `rollout/server_paused_s`."""

    def __init__(self, client: VLLMClient) -> None:
        self.client = client
        self.supported = True
        """False once the server answered 404 (no dev mode): it cannot say, and is not asked again."""
        self._asked_at = float("-inf")
        self._clear_at = float("-inf")
        """When the server last said it is not paused."""
        self._held_since: float | None = None
        """Since when generation has been held, as far as the client can tell (None: not seen paused)."""
        self._first_paused_at = self._last_paused_at = 0.0
        self._warned = False

    @property
    def held_s(self) -> float:
        """Seconds the pause warned about has lasted so far (0: none; a short pause is not counted)."""
        if not self._warned or self._held_since is None:
            return 0.0
        return time.monotonic() - self._held_since

    def forget(self) -> None:
        """The server's process is gone or replaced: whatever pause it had ended with it (no message)."""
        self._held_since, self._warned = None, False

    async def check(self) -> None:
        """Ask `/is_paused` if generation requests stall; warn once per pause, note its end once."""
        client, now = self.client, time.monotonic()
        if self._held_since is not None and client.progress_at > self._last_paused_at:
            self._end(now)  # a request finished since the last answer: generation runs again
        stalled = client.stalled_s()
        if not self.supported or stalled < STALL_S or now - self._asked_at < ASK_EVERY_S:
            return
        self._asked_at = now
        paused = await self._ask()
        if paused is None:
            return
        if not paused:
            self._clear_at = now
            self._end(now)
            return
        if self._held_since is None:
            self._held_since = max(client.progress_at, self._clear_at)
            self._first_paused_at = now
        self._last_paused_at = now
        if not self._warned and now - self._first_paused_at >= ASK_EVERY_S and stalled >= WARN_AFTER_S:
            self._warned = True
            url = client.base_url
            logger.warning(
                "vLLM server %s is paused: its %d requests in flight have waited %.0f s with none finished, and "
                "GET /is_paused says generation is held by /pause (a weight sync in progress, or a trainer killed "
                "during one). If no trainer is syncing it, POST %s/resume serves its weights as they are (after a "
                "killed disk sync, restarting the trainer with resume_from_checkpoint re-syncs it), or restart the "
                "server; the loop waits for it (rollout/server_paused_s)",
                url, client.generating, stalled, url,
            )  # fmt: skip

    async def _ask(self) -> bool | None:
        """The server's `is_paused`, or None when it cannot tell now (the watch's `/metrics` read owns health)."""
        timeout = min(_ASK_TIMEOUT_S, self.client.config.vllm_server_timeout)
        try:
            response = await self.client.request(
                "GET", "/is_paused", allow_status=(404,), attempts=1, timeout=timeout
            )
        except ServerUnavailableError:
            return None
        except RequestRejectedError as error:  # a server that refuses the route cannot say: stop asking
            self.supported = False
            logger.debug("%s/is_paused: %s; not asked again", self.client.base_url, error)
            return None
        if response.status_code == 404:
            self.supported = False
            logger.debug(
                "%s has no /is_paused (no VLLM_SERVER_DEV_MODE); not asked again", self.client.base_url
            )
            return None
        try:
            body = json_body(response)
        except ResponseFormatError:
            return None
        paused = body.get("is_paused") if isinstance(body, dict) else None
        return paused if isinstance(paused, bool) else None

    def _end(self, now: float) -> None:
        if self._held_since is not None and self._warned:
            logger.info(
                "vLLM server %s generates again after about %.0f s paused",
                self.client.base_url, now - self._held_since,
            )  # fmt: skip
        self.forget()
