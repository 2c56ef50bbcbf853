"""Fixtures of agrpo-rollout's tests: configs pointed at the session's real vLLM server, and a proxy in
front of it for the faults a real server does not make on demand (500s, hangs, dropped connections,
a 200 whose body is not JSON)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agrpo_rollout import RolloutConfig


class FaultProxy:
    """A loopback HTTP/1.1 proxy in front of the real server. Each request to `/v1/completions` consumes
    one fault: `500` answers 500, `hang` never answers, `drop` closes the connection, `html` answers 200
    with an HTML page (a misrouted gateway), `pass` forwards. Every other path is forwarded."""

    def __init__(self, upstream: str, faults: list[str]) -> None:
        self.upstream, self.faults, self.seen = upstream, list(faults), []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.client = httpx.AsyncClient(base_url=self.upstream, timeout=60)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.client.aclose()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path, _ = head.split("\r\n", 1)[0].split(" ")
        length = next(
            (
                int(line.split(":")[1])
                for line in head.split("\r\n")
                if line.lower().startswith("content-length")
            ),
            0,
        )
        body = await reader.readexactly(length)
        fault = self.faults.pop(0) if path.startswith("/v1/completions") and self.faults else "pass"
        self.seen.append(fault)
        if fault == "drop":
            writer.close()
            return
        if fault == "hang":
            await asyncio.sleep(60)
            return
        if fault == "500":
            status, content = 500, b'{"error":"injected"}'
        elif fault == "html":
            status, content = 200, b"<html><body>Welcome to the gateway</body></html>"
        else:
            upstream = await self.client.request(
                method, path, content=body, headers={"content-type": "application/json"}
            )
            status, content = upstream.status_code, upstream.content
        writer.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, len(content))
            + content
        )
        await writer.drain()
        writer.close()


@pytest.fixture
def fault_proxy(vllm_server):
    """A factory of `FaultProxy`s in front of the session's server: `async with fault_proxy([...]) as url`."""
    return lambda faults: FaultProxy(vllm_server.url, faults)


@pytest.fixture
def server_config(vllm_server):
    """A factory of small, fast `RolloutConfig`s for the shared CPU vLLM server."""

    def make(**overrides) -> RolloutConfig:
        fields = {
            "vllm_server_base_url": vllm_server.url,
            "num_generations": 2,
            "max_completion_length": 12,
            "max_concurrent_rollouts": 8,
            "metrics_poll_interval_s": 0.2,
            "metrics_interval_s": 0.2,
            "vllm_retry_backoff_s": 0.05,
        }
        fields.update(overrides)
        return RolloutConfig(**fields)

    return make
