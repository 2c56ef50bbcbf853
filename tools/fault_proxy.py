"""`FaultProxy`: a loopback HTTP/1.1 proxy in front of a real vLLM server that breaks a share of requests.

Owns fault injection for the faults a healthy server does not make on demand: an HTTP 500 instead of an
answer (`500`) or after the server did the work (`500_after`: the answer is lost), a connection closed
without an answer (`drop`), an answer held back for a while (`slow`, then forwarded) and one that never
comes (`hang`). Which request gets which fault is decided by a `FaultMix` (a seeded random share of
each kind) or any callable `(method, path, body) -> fault`; only paths under `paths` (default the
sampling routes) are eligible, so control calls pass untouched unless asked. It serves on 127.0.0.1 only,
on its own thread and event loop, so synchronous code (a trainer) and asynchronous code (a rollout loop)
use it alike, and it holds up under hundreds of concurrent requests (the soak, `tools/soak.py`). Every
answer closes its connection, as vLLM does after an error, so clients reconnect as they would in
production. Does not know what the requests mean: it forwards bytes and counts faults (`counts`).

Beside it, every fault-tolerance test also runs against the real server's own refusals (see
`docs/reliability.md`): the proxy adds only what a real server cannot be asked to do.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx

FAULTS = ("pass", "500", "500_after", "drop", "slow", "hang")
SAMPLING_PATHS = ("/v1/completions", "/inference/v1/generate")


@dataclass(kw_only=True)
class FaultMix:
    """A seeded random fault per eligible request: each kind with its own probability, else `pass`."""

    error_500: float = 0.0
    drop: float = 0.0
    slow: float = 0.0
    hang: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        total = self.error_500 + self.drop + self.slow + self.hang
        if not 0.0 <= total <= 1.0 or min(self.error_500, self.drop, self.slow, self.hang) < 0:
            raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1, got {self}")
        self._random = random.Random(self.seed)

    def __call__(self, method: str, path: str, body: bytes) -> str:
        draw = self._random.random()
        shares = (("500", self.error_500), ("drop", self.drop), ("slow", self.slow), ("hang", self.hang))
        for fault, share in shares:
            if draw < share:
                return fault
            draw -= share
        return "pass"


def _content_length(head: str) -> int:
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return int(value.strip())
    return 0


class FaultProxy:
    """`with FaultProxy(upstream, FaultMix(error_500=0.05)) as proxy:` requests to `proxy.url` reach
    `upstream`, except the ones the policy breaks; `proxy.counts` counts what each request got."""

    def __init__(
        self,
        upstream: str,
        policy: Callable[[str, str, bytes], str] | None = None,
        *,
        paths: tuple[str, ...] = SAMPLING_PATHS,
        slow_s: tuple[float, float] = (0.5, 2.0),
        hang_s: float = 3600.0,
        upstream_keepalive: bool = True,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.policy = policy if policy is not None else FaultMix()
        self.paths, self.slow_s, self.hang_s = paths, slow_s, hang_s
        self.upstream_keepalive = upstream_keepalive
        """False: one upstream connection per request, so the proxy holds no socket between requests (the
        soak counts this process's file descriptors)."""
        self.counts: Counter[str] = Counter()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._delays = random.Random(1)

    def start(self) -> str:
        """Serve on a free 127.0.0.1 port; returns the proxy's URL."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout=30)
        return self.url

    async def _open(self) -> None:
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512 if self.upstream_keepalive else 0)
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=3600.0, limits=limits)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        """Close the listener, every open connection and the upstream client, then end the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _close(self) -> None:
        self._server.close()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()
        await asyncio.sleep(0)
        await self._client.aclose()
        await self._server.wait_closed()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _fault(self, method: str, path: str, body: bytes) -> str:
        fault = self.policy(method, path, body) if path.startswith(self.paths) else "pass"
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; use one of {FAULTS}")
        self.counts[fault] += 1
        return fault

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            body = await reader.readexactly(_content_length(head))
            fault = self._fault(method, path, body)
            if fault == "drop":
                return
            if fault == "hang":
                await asyncio.sleep(self.hang_s)
                return
            if fault == "slow":
                await asyncio.sleep(self._delays.uniform(*self.slow_s))
            status, content = await self._answer(fault, method, path, body)
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, len(content))
                + content
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            return  # the client went away first (a timeout on its side): nothing to answer
        finally:
            writer.close()

    async def _answer(self, fault: str, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if fault == "500":
            return 500, b'{"error": "injected by FaultProxy"}'
        headers = {"content-type": "application/json"} if body else {}
        try:
            response = await self._client.request(method, path, content=body, headers=headers)
        except httpx.TransportError as error:  # the upstream itself failed: say so as a gateway would
            return 502, f'{{"error": "upstream: {type(error).__name__}"}}'.encode()
        if fault == "500_after":
            return 500, b'{"error": "injected by FaultProxy after the server answered"}'
        return response.status_code, response.content
