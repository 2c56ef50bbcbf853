"""Fixtures of agrpo-rollout's tests: configs pointed at the session's real vLLM server, and a proxy in
front of it for the faults a real server does not make on demand (500s, hangs, dropped connections,
a 200 whose body is not JSON) and for the MoE routes a CPU server cannot return (`RoutesProxy`)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest

from agrpo_rollout import RolloutConfig


class FaultProxy:
    """A loopback HTTP/1.1 proxy in front of the real server. Each request to `/v1/completions` consumes
    one fault: `500` answers 500, `hang` never answers, `drop` closes the connection, `html` answers 200
    with an HTML page (a misrouted gateway), `pass` forwards. Every other path is forwarded."""

    def __init__(self, upstream: str, faults: list[str]) -> None:
        self.upstream, self.faults, self.seen = upstream, list(faults), []

    def rewrite(self, path: str, request: bytes, content: bytes) -> bytes:
        """The body passed back for a forwarded answer (subclasses edit it)."""
        return content

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
            status, content = upstream.status_code, self.rewrite(path, body, upstream.content)
        writer.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, len(content))
            + content
        )
        await writer.drain()
        writer.close()


class RoutesProxy(FaultProxy):
    """The real server's completions with `routed_experts` added to each choice as vLLM 0.32 adds it
    (`vllm/utils/serial_utils.py` `numpy2base64` of a (prompt + completion - 1 - routed_experts_prompt_start,
    layers, top_k) uint16 array): what a GPU server started with `--enable-return-routed-experts` returns.
    Each token's route depends on the token only (`proxy_route`), so requests agree on shared tokens.
    `starts` records each request's `routed_experts_prompt_start`."""

    model_config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "num_experts": 300,
        "num_experts_per_tok": 2,
    }
    """The MoE model it pretends the server serves (more than 256 experts: vLLM sends uint16)."""

    @classmethod
    def route(cls, tokens: np.ndarray) -> np.ndarray:
        """(n, 3, 2) the route of each token, whatever its position; layer 0 is dense (zeros)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        routes = (tokens[:, None, None] * 7 + np.arange(3)[:, None] * 3 + np.arange(2)) % 300
        routes[:, 0] = 0
        return routes

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream, [])
        self.starts: list[int] = []

    def rewrite(self, path: str, request: bytes, content: bytes) -> bytes:
        if not path.startswith("/v1/completions"):
            return content
        sent, body = json.loads(request), json.loads(content)
        start = sent.get("routed_experts_prompt_start", 0)
        self.starts.append(start)
        for choice in body["choices"]:
            tokens = np.asarray(sent["prompt"] + choice["token_ids"])
            with io.BytesIO() as buffer:
                np.save(buffer, self.route(tokens[start:-1]).astype(np.uint16), allow_pickle=False)
                choice["routed_experts"] = base64.b64encode(buffer.getbuffer()).decode("ascii")
        return json.dumps(body, separators=(",", ":")).encode()


@pytest.fixture
def routes_proxy(vllm_server):
    """A `RoutesProxy` in front of the session's server: `async with routes_proxy() as url`, then `.starts`."""
    return lambda: RoutesProxy(vllm_server.url)


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
