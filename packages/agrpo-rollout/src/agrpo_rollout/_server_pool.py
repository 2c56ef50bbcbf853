"""`ServerPool`: the vLLM servers one loop generates from, and which of them a group goes to.

Owns opening every server of `vllm_server_base_url` (health, start-up probe, one concurrency controller
each, its cap starting at that server's own full-length fit), the choice of a server per group, the bound
on rollouts in flight over all servers (`max_concurrent_rollouts`), and the `rollout/` metrics of the
servers. Does not know groups, prompts or weights: the loop asks for a slot, and each `PooledServer`
decides whether it may take work (`_pooled_server.py`).

Balance: a group goes to the serving server with the most free slots under its own live cap (each cap is
steered by that server's `/metrics`, so a server with a larger KV cache, or a lighter load, takes more),
ties to the one with fewer in flight. All rollouts of a group go to the server its first one went to,
and all turns of a rollout: the server's prefix cache then holds the shared prompt. One server is the
special case of this: the same cap, the same metrics as before servers came in lists.

Waiting: when no server can take a group, the dispatcher waits; when none has served for
`vllm_server_timeout` seconds (all down, or all waiting for a re-sync that never came), the run fails
with `ServerUnavailableError` naming each server's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from ._client import VLLMClient
from ._concurrency import ConcurrencyController
from ._config import RolloutConfig
from ._exceptions import ServerUnavailableError
from ._pooled_server import PooledServer
from ._server_event import SERVING, ServerEvent


class ServerPool:
    """The loop's servers; `acquire` a group's first slot, `acquire_on` its others, `release` each."""

    def __init__(self, servers: list[PooledServer], *, bound: int, changed: asyncio.Condition) -> None:
        self.servers = servers
        self.bound = bound
        self._changed = changed
        self._unserved_since: float | None = None

    @classmethod
    async def open(
        cls,
        config: RolloutConfig,
        *,
        policy_version: Callable[[], int],
        on_event: Callable[[ServerEvent], None] | None = None,
    ) -> ServerPool:
        """Wait for every server to be healthy, probe each (`ServerInfo`), and start each one's cap at
        `KV cache tokens // max_model_len` (the bound with `concurrency_control="fixed"` or no `/metrics`)."""
        clients = [await VLLMClient(config, base_url=url).open() for url in config.server_urls]
        await asyncio.gather(*(client.wait_until_ready() for client in clients))
        changed = asyncio.Condition()
        bound, control = config.max_concurrent_rollouts, config.concurrency_control
        servers = []
        for index, client in enumerate(clients):
            info = await client.probe()
            adaptive = info.kv_cache_tokens and control != "fixed"
            initial = info.initial_concurrency(bound) if adaptive else None
            rule = "goodput" if control == "fixed" else control
            servers.append(
                PooledServer(
                    index, client, ConcurrencyController(bound, initial, rule=rule, watermark=info.watermark or 0.0),
                    changed=changed,
                    policy_version=policy_version, on_event=on_event, started_at=info.started_at,
                )
            )  # fmt: skip
        return cls(servers, bound=bound, changed=changed)

    @property
    def in_flight(self) -> int:
        return sum(s.controller.in_flight for s in self.servers)

    @property
    def retry_total(self) -> int:
        return sum(s.client.retry_total for s in self.servers)

    def _candidate(self) -> PooledServer | None:
        """The serving server with the most free slots under its cap (None: none has one, or the bound is hit)."""
        if self.in_flight >= self.bound:
            return None
        room = [s for s in self.servers if s.state == SERVING and s.controller.has_room]
        if not room:
            return None
        return max(
            room, key=lambda s: (s.controller.cap - s.controller.in_flight, -s.controller.in_flight, -s.index)
        )

    async def acquire(self) -> PooledServer:
        """A slot for a group's first rollout, on the server that group will use; waits while none can take it."""
        while True:
            server = await self._wait_for(self._candidate)
            if await server.confirm_weights() and server.controller.try_acquire():
                return server

    async def acquire_on(self, server: PooledServer) -> None:
        """A slot for another rollout of a group on `server` (under its cap and the pool's bound)."""
        await self._wait_for(
            lambda: server if server.controller.has_room and self.in_flight < self.bound else None
        )
        server.controller.try_acquire()

    async def release(self, server: PooledServer) -> None:
        """A rollout on `server` ended (completed or not): its slot is free."""
        await server.controller.release()
        async with self._changed:
            self._changed.notify_all()

    async def _wait_for(self, pick: Callable[[], PooledServer | None]) -> PooledServer:
        """`pick()` once it returns a server; fails when no server has served for `vllm_server_timeout`."""
        timeout = self.servers[0].config.vllm_server_timeout
        async with self._changed:
            while (server := pick()) is None:
                self._check_served(timeout)
                # asyncio.timeout keeps a cancel (see PooledServer.watch)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(1.0, timeout)):
                        await self._changed.wait()
            return server

    def _check_served(self, timeout: float) -> None:
        if any(s.state == SERVING for s in self.servers):
            self._unserved_since = None
            return
        now = time.monotonic()
        self._unserved_since = self._unserved_since or now
        if now - self._unserved_since > timeout:
            states = ", ".join(
                f"{s.url}: {s.state}" + (f" ({s.detail})" if s.detail else "") for s in self.servers
            )
            raise ServerUnavailableError(
                f"no vLLM server has served for {timeout:g} s ({states}); check that the servers are up (a "
                "restarted one rejoins once the trainer has re-synced it), or raise vllm_server_timeout"
            )

    def metrics(self) -> dict[str, float]:
        """`rollout/concurrency*` and the server gauges (summed, KV usage the maximum), and with several
        servers the same per server under `rollout/server/<i>/`, with `serving` (1 or 0) and `paused_s`;
        `rollout/server_paused_s` is the longest pause under way that a warning named (0: none)."""
        if len(self.servers) == 1:
            out = self.servers[0].controller.metrics()
        else:
            out = _combined([s.controller.metrics() for s in self.servers], self.bound)
            for server in self.servers:
                for key, value in server.controller.metrics().items():
                    out[key.replace("rollout/", f"rollout/server/{server.index}/", 1)] = value
                out[f"rollout/server/{server.index}/serving"] = float(server.state == SERVING)
                out[f"rollout/server/{server.index}/paused_s"] = server.pause.held_s
        out["rollout/server_paused_s"] = max(s.pause.held_s for s in self.servers)
        out["rollout/servers_serving"] = float(sum(s.state == SERVING for s in self.servers))
        out["rollout/server_restarts_total"] = float(sum(s.restarts_total for s in self.servers))
        return out

    async def close(self) -> None:
        for server in self.servers:
            await server.client.close()


def _combined(per_server: list[dict[str, float]], bound: int) -> dict[str, float]:
    """Several servers' `rollout/` gauges as one: counts summed, KV usage the maximum, the cap bounded."""
    out: dict[str, float] = {}
    for metrics in per_server:
        for key, value in metrics.items():
            out[key] = (
                max(out.get(key, 0.0), value)
                if key == "rollout/kv_cache_usage"
                else out.get(key, 0.0) + value
            )
    out["rollout/concurrency_cap"] = float(min(bound, out.get("rollout/concurrency_cap", bound)))
    return out
