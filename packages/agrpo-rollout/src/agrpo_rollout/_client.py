"""`VLLMClient`: the async HTTP client of one vLLM server (httpx), with retries.

Owns requests, the retry policy, the start-up probe call and the sampling request bodies of both
generation routes. Does not know chat templates, tools or concurrency: callers decide what to send
and how many requests are in flight.

Retry policy: connection errors, timeouts, 5xx, 408 and 429 are retried with exponential backoff
(`vllm_retry_backoff_s`, doubling, capped at 16 s) up to `vllm_max_retries` times, each counted in
`retry_total` (`rollout/vllm_retry_total`) and logged at most once per 10 s (with the count since the
previous line), so a server that is down is visible at once without flooding the log; other 4xx raise
`RequestRejectedError` at once because the same request would fail again (the reference retried those
30 times). A prompt that leaves no room under `max_model_len` returns an empty `length` turn without a
request.

Under a `ServerPool` the client also has a `gate` (its `PooledServer`): each attempt of a rollout's request
first passes `gate.admit()` (it waits out an identity check, and raises `ServerLostError` once the process
the rollout was generating on is gone), and a transport failure is reported to `gate.transport_failed()`
before the retry, so the next attempt goes to a server that was checked. Requests outside a rollout (the
start-up probe, the pool's own checks) are not gated. The client also counts its generation requests in
flight and when one last finished (`stalled_s`): a server paused by `/pause` holds them without an error,
which is how `ServerPause` (`_server_pause.py`) sees it.

With `return_routed_experts`, each sampling request sends `routed_experts_prompt_start` (the caller's
`routes_from`) and the decoders return each token's MoE route (`_routed_experts.py`);
`check_routed_experts` is the start-up check a trainer calls before it spawns its rollout process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from typing import Any, Protocol

import httpx
import numpy as np

from ._candidate_set import candidate_logprobs, split_candidate_sets
from ._completion_response import decode_completion, decode_generate
from ._config import RolloutConfig
from ._exceptions import RequestRejectedError, ServerUnavailableError
from ._request_seed import REQUEST_SEEDS, RequestSeeds
from ._server import COMPLETIONS_PATH, GENERATE_PATH, ServerInfo, probe_server
from ._server_load import ServerLoad
from ._turn import TurnRecord

logger = logging.getLogger("agrpo_rollout")

POLICY_VERSION: ContextVar[int] = ContextVar("agrpo_policy_version", default=0)
"""The policy version of the group a request belongs to; the loop sets it when it dispatches a group, and a
`model_name` template with `{version}` (LoRA adapter sync) names that version's adapter."""
KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle pooled connection is reused. vLLM's server (uvicorn) closes an idle connection after
`VLLM_HTTP_TIMEOUT_KEEP_ALIVE` = 5 s; with httpx's default of 5 s too, a request that reuses a connection the
server is closing at that instant fails with a reset (`ReadError`) and is retried: the retries a healthy
server showed. Well under the server's limit, a healthy run retries nothing."""
_MAX_BACKOFF_S = 16.0
_RETRY_STATUS = frozenset({408, 429})
_RETRY_LOG_INTERVAL_S = 10.0
_GENERATION_PATHS = frozenset({COMPLETIONS_PATH, GENERATE_PATH, "/v1/chat/completions"})


class RequestGate(Protocol):
    """What a `ServerPool` puts in front of a client's requests (see the module docstring)."""

    async def admit(self) -> None: ...

    async def transport_failed(self, error: Exception) -> None: ...


class VLLMClient:
    """Talks to one vLLM server: `open`, `probe`, then `sample` and `load` as often as needed."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        base_url: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.base_url = (base_url or config.server_urls[0]).rstrip("/")
        """This client's server: `base_url`, or the config's first one."""
        self.retry_total = 0
        self.generating = 0
        """Generation requests (`/v1/completions`, `/inference/v1/generate`, chat) waiting for an answer now."""
        self.progress_at = time.monotonic()
        """When a generation request last ended, or one started with none in flight (`stalled_s`)."""
        self.gate: RequestGate | None = None
        self.server: ServerInfo | None = None
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._own_seeds = None if config.seed is None else RequestSeeds(config.seed)
        self.routing = config.expert_routing
        """The routes' expected shape when `return_routed_experts` is on (parsed once), else None."""
        self._retry_logged_at = float("-inf")
        self._retries_since_log = 0

    async def open(self) -> VLLMClient:
        """Create the connection pool (sized so the pool never caps concurrency below the bound)."""
        if self._http is None:
            connections = self.config.max_concurrent_rollouts + 8
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=httpx.Timeout(
                    self.config.vllm_server_timeout, connect=min(10.0, self.config.vllm_server_timeout)
                ),
                limits=httpx.Limits(
                    max_connections=connections,
                    max_keepalive_connections=connections,
                    keepalive_expiry=KEEPALIVE_EXPIRY_S,
                ),
                transport=self._transport,
            )
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> VLLMClient:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _backoff_s(self, attempt: int) -> float:
        return min(self.config.vllm_retry_backoff_s * 2**attempt, _MAX_BACKOFF_S)

    async def request(
        self,
        method: str,
        path: str,
        *,
        allow_status: tuple[int, ...] = (),
        attempts: int | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request with retries (`attempts` in all, default `vllm_max_retries + 1`); 2xx and
        `allow_status` answers are returned, other 4xx raise. `ServerUnavailableError` has the last transport
        error, if any, as its `__cause__`."""
        if self._http is None:
            await self.open()
        attempts = self.config.vllm_max_retries + 1 if attempts is None else attempts
        last_error, last_exc = "", None
        for attempt in range(attempts):
            if attempt:
                self.retry_total += 1
                self._log_retry(f"{method} {self.base_url}{path}", last_error, attempt, attempts - 1)
                await asyncio.sleep(self._backoff_s(attempt - 1))
            if self.gate is not None:
                await self.gate.admit()
            try:
                response = await self._timed_request(method, path, **kwargs)
            except httpx.TransportError as exc:  # connection refused/reset, timeouts, protocol errors
                last_error, last_exc = f"{type(exc).__name__}: {exc}", exc
                if self.gate is not None:
                    await self.gate.transport_failed(exc)
                continue
            last_exc = None
            if response.status_code < 400 or response.status_code in allow_status:
                return response
            if response.status_code >= 500 or response.status_code in _RETRY_STATUS:
                last_error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            raise RequestRejectedError(
                f"{method} {self.base_url}{path} answered {response.status_code}: {response.text[:500]}",
                response.status_code,
            )
        raise ServerUnavailableError(
            f"{method} {self.base_url}{path} failed {attempts} times; last error: "
            f"{last_error}. Check that the server is up, or raise vllm_max_retries / vllm_server_timeout"
        ) from last_exc

    async def _timed_request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One attempt; a generation request is counted in `generating` while it waits (`stalled_s`)."""
        if path not in _GENERATION_PATHS:
            return await self._http.request(method, path, **kwargs)
        if not self.generating:
            self.progress_at = time.monotonic()
        self.generating += 1
        try:
            return await self._http.request(method, path, **kwargs)
        finally:
            self.generating -= 1
            self.progress_at = time.monotonic()

    def stalled_s(self) -> float:
        """Seconds generation requests have been in flight with none finished (0 with none in flight): how a
        paused server shows from here (`ServerPause`)."""
        return time.monotonic() - self.progress_at if self.generating else 0.0

    def _log_retry(self, request: str, error: str, attempt: int, retries: int) -> None:
        """One warning per `_RETRY_LOG_INTERVAL_S` at most, counting the retries it stands for."""
        self._retries_since_log += 1
        now = time.monotonic()
        if now - self._retry_logged_at < _RETRY_LOG_INTERVAL_S:
            return
        logger.warning(
            "%s failed (%s); retry %d of %d in %.1f s (this line stands for %d retries, one line per %.0f s "
            "at most; rollout/vllm_retry_total counts them)",
            request, error, attempt, retries, self._backoff_s(attempt - 1),
            self._retries_since_log, _RETRY_LOG_INTERVAL_S,
        )  # fmt: skip
        self._retry_logged_at, self._retries_since_log = now, 0

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Poll `GET /health` until it answers 200, for at most `timeout_s` (default: vllm_server_timeout)."""
        if self._http is None:
            await self.open()
        timeout_s = self.config.vllm_server_timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                response = await self._http.get(
                    "/health", timeout=min(5.0, max(deadline - time.monotonic(), 0.1))
                )
                if response.status_code == 200:
                    return
                if response.status_code in (404, 405):  # something answers, but it is no vLLM root
                    raise ServerUnavailableError(
                        f"{self.base_url}/health answered {response.status_code}: {self.base_url} is not the "
                        "root of a vLLM server; check the URL's host, port and path (no /v1)"
                    )
                last = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:  # still starting: retried until the deadline
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        raise ServerUnavailableError(
            f"{self.base_url}/health did not answer 200 within {timeout_s:g} s (last: {last}); check "
            "vllm_server_base_url (the server's root, e.g. http://localhost:8000), or raise vllm_server_timeout "
            "if the server is still starting"
        )

    async def probe(self) -> ServerInfo:
        """Read and check the server's capabilities once (see `ServerInfo`)."""
        self.server = await probe_server(self, self.config)
        return self.server

    async def load(self) -> ServerLoad | None:
        """The server's current load from `/metrics`, or None when it exports none."""
        response = await self.request("GET", "/metrics", allow_status=(404,))
        return ServerLoad.from_text(response.text) if response.status_code == 200 else None

    async def sample(
        self, prompt_ids: list[int] | np.ndarray, *, max_tokens: int | None = None, routes_from: int = 0
    ) -> TurnRecord:
        """Sample one completion of `prompt_ids` with the config's sampling parameters. With
        `return_routed_experts`, the server returns routes from prompt position `routes_from` on (earlier
        turns of the rollout hold the ones before; the turn's record has -1 there)."""
        server = self.server or await self.probe()
        prompt = [int(t) for t in prompt_ids]
        room = server.max_model_len - len(prompt)
        max_tokens = min(max_tokens or self.config.max_completion_length, room)
        if max_tokens <= 0:
            unrouted = None if self.routing is None else self.routing.unrouted(len(prompt))
            return TurnRecord(
                prompt_ids=prompt,
                output_ids=[],
                output_log_probs=[],
                finish_reason="length",
                routed_experts=unrouted,
            )
        num_top = self.config.num_sampler_logprobs
        routes = {"routing": self.routing, "routes_from": routes_from}
        if server.uses_generate_endpoint:
            body = self.generate_body(prompt, max_tokens, routes_from=routes_from)
            response = await self.request("POST", GENERATE_PATH, json=body)
            return decode_generate(response.content, prompt, num_top, **routes)
        body = self.completion_body(prompt, max_tokens, routes_from=routes_from)
        response = await self.request("POST", COMPLETIONS_PATH, json=body)
        if not self.config.truncates_vocabulary:
            return decode_completion(response.content, prompt, num_top, **routes)
        turn = decode_completion(response.content, prompt, candidate_logprobs(self.config), **routes)
        if turn.output_sampler_logprobs is not None:  # candidate sets from the processed log-probs
            turn.output_sampler_logprobs, turn.output_sampling_mask = split_candidate_sets(
                turn.output_sampler_logprobs, turn.output_ids, self.config, self.base_url
            )
        return turn

    def request_model(self) -> str | None:
        """The `model` of a request: a `{version}` template names the adapter of the group's policy version."""
        name = self.config.model_name
        if name is not None and "{version}" in name:
            return name.format(version=POLICY_VERSION.get())
        return self.server.model_name if self.server else name

    def _sampling_fields(self, routes_from: int = 0) -> dict[str, Any]:
        """The config's sampling parameters, plus this request's seed when the config has one, and where
        routes start when it asks for routes."""
        fields = self.config.sampling_fields()
        if self.config.seed is not None:
            fields["seed"] = (REQUEST_SEEDS.get() or self._own_seeds).next()
        if self.routing is not None:
            fields["routed_experts_prompt_start"] = routes_from
        return fields

    def completion_body(self, prompt: list[int], max_tokens: int, *, routes_from: int = 0) -> dict[str, Any]:
        """`/v1/completions` body: token-id prompt, ids as ids (distinct tokens never collapse). The
        client's own fields come last, so `extra_request_fields` can never replace them."""
        return {
            **self.config.extra_request_fields,
            "model": self.request_model(),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "n": 1,
            "logprobs": candidate_logprobs(self.config),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            **self._sampling_fields(routes_from),
        }

    def generate_body(self, prompt: list[int], max_tokens: int, *, routes_from: int = 0) -> dict[str, Any]:
        """`/inference/v1/generate` body; asks for one extra log-prob so the top K survive a sampled token
        outside them (see `decode_generate`), and for no detokenisation."""
        num_top = self.config.num_sampler_logprobs
        return {
            "model": self.request_model(),
            "token_ids": prompt,
            "sampling_params": {
                **self.config.extra_request_fields,
                "max_tokens": max_tokens,
                "n": 1,
                "logprobs": num_top + 1 if num_top else 0,
                "detokenize": False,
                **self._sampling_fields(routes_from),
            },
        }


def check_routed_experts(config: RolloutConfig) -> None:
    """Start-up check of MoE routing replay, for callers outside an event loop (the trainer, before it
    spawns its rollout process): probe every server of `config` as a rollout loop would, which for
    `return_routed_experts=True` samples one token and raises `ServerConfigError` naming
    `--enable-return-routed-experts` when the server returns no routes (a CPU server never does), or
    `ResponseFormatError` when they do not fit `model_config`. A dense `model_config` was already refused
    by `RolloutConfig`."""
    if not config.return_routed_experts:
        raise ValueError("check_routed_experts needs return_routed_experts=True in the config it checks")

    async def probe_all() -> None:
        for url in config.server_urls:
            async with VLLMClient(config, base_url=url) as client:
                await client.probe()

    asyncio.run(probe_all())
