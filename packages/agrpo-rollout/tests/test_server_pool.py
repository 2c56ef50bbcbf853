"""`ServerPool` and `PooledServer` against the real CPU vLLM server: groups balanced by each server's cap and
kept on one server, a dropped connection checked and re-sent, and a server that dies mid-run: its groups are
generated again elsewhere, and once it answers as a new process it rejoins only after its weights are the
published version.

Two "servers" here are two `ServerDouble`s in front of the session's one real server (a second real server
costs a minute of start-up; the trainer's tests kill and restart real ones): each double has its own port,
its own process identity (`process_start_time_seconds` in `/metrics`) and its own weight label
(`/weight_info`, `/update_weight_version`), and can die (its port refuses connections, its open connections
are cut) and come back on the same port as a new process. Everything else is the real server's answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter, defaultdict

import httpx
import pytest

from agrpo_rollout import AsyncRolloutLoop, RolloutConfig, ServerUnavailableError

pytestmark = pytest.mark.server


class ServerDouble:
    """A loopback proxy to the real server with its own identity; `die()`, then `restart()` on the same port."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.started_at = time.time()
        self.label = "1"
        self.port = 0
        self.completions: list[str] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ServerDouble:
        self.client = httpx.AsyncClient(base_url=self.upstream, timeout=60)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def die(self) -> None:
        """The process is gone: the port refuses connections and every open one is cut."""
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    async def restart(self) -> None:
        """A new process on the same port, on its start-up weights (label `default`)."""
        self.started_at, self.label = time.time(), "default"
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def stop(self) -> None:
        self._server.close()
        await self.client.aclose()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n", 1)[0].split(" ")
            length = re.search(r"(?im)^content-length:\s*(\d+)", head)
            body = await reader.readexactly(int(length.group(1)) if length else 0)
            status, content = await self._answer(method, path, body)
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, len(content))
                + content
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the double died under this request
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/weight_info":
            return 200, json.dumps({"weight_version": self.label}).encode()
        if path == "/update_weight_version":
            self.label = json.loads(body)["new_version"]
            return 200, b'{"success": true}'
        headers = {"content-type": "application/json"} if body else {}
        upstream = await self.client.request(method, path, content=body, headers=headers)
        content = upstream.content
        if path == "/metrics":
            content = re.sub(
                rb"(?m)^process_start_time_seconds .*$",
                b"process_start_time_seconds %f" % self.started_at,
                content,
            )
        if path.startswith("/v1/completions"):
            self.completions.append(path)
        return upstream.status_code, content


def _config(urls: list[str], **overrides) -> RolloutConfig:
    fields = dict(
        vllm_server_base_url=urls, num_generations=2, max_completion_length=8, max_concurrent_rollouts=8,
        metrics_poll_interval_s=0.2, metrics_interval_s=0.2, vllm_retry_backoff_s=0.05, vllm_server_timeout=60,
    )  # fmt: skip
    fields.update(overrides)
    return RolloutConfig(**fields)


def _prompts(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(n)]


def length_reward(completions, **_):
    return [float(len(str(c))) + 0.01 * i for i, c in enumerate(completions)]


class WhereLoop(AsyncRolloutLoop):
    """Records which server served each turn of each group, and the most rollouts in flight per server."""

    async def setup(self) -> None:
        self.served: dict[int, set[str]] = defaultdict(set)
        self.peak: Counter = Counter()

    async def generate_one(self, prompt, tools, group_id=0):
        self.served[group_id].add(self.client.base_url)
        for server in self.pool.servers:
            self.peak[server.url] = max(self.peak[server.url], server.controller.in_flight)
        return await super().generate_one(prompt, tools, group_id)


def test_groups_go_by_each_servers_free_slots_and_stay_on_one_server(vllm_server, tool_tokenizer):
    class Capped(WhereLoop):
        async def setup(self) -> None:
            await super().setup()
            for server, cap in zip(self.pool.servers, (1, 3), strict=True):
                server.controller.cap = cap  # `fixed`: no rule moves them

    async def go():
        a, b = await ServerDouble(vllm_server.url).start(), await ServerDouble(vllm_server.url).start()
        try:
            loop = Capped(
                _config([a.url, b.url], concurrency_control="fixed", max_concurrent_rollouts=4),
                tokenizer=tool_tokenizer, dataset=_prompts(16), reward_funcs=length_reward, max_epochs=1,
            )  # fmt: skip
            outcomes = []
            await loop.run(lambda s: None, on_group=outcomes.append)
            return loop, outcomes, a, b
        finally:
            await a.stop()
            await b.stop()

    loop, outcomes, a, b = asyncio.run(go())
    assert len(outcomes) == 16 and all(len(urls) == 1 for urls in loop.served.values())
    per_server = Counter(next(iter(urls)) for urls in loop.served.values())
    assert per_server[b.url] > per_server[a.url] > 0, per_server
    assert loop.peak[a.url] <= 1 and loop.peak[b.url] <= 3


def test_a_dropped_connection_is_checked_and_re_sent_to_the_same_process(
    fault_proxy, server_config, tool_tokenizer
):
    events = []

    async def go():
        async with fault_proxy(["pass", "drop", "pass", "drop"]) as url:
            loop = AsyncRolloutLoop(
                server_config(vllm_server_base_url=url), tokenizer=tool_tokenizer, dataset=_prompts(3),
                reward_funcs=length_reward, max_epochs=1,
            )  # fmt: skip
            metrics, outcomes = [], []
            await loop.run(
                lambda s: None, on_group=outcomes.append, metrics_sink=metrics.append, on_server=events.append
            )
            return metrics[-1], outcomes

    last, outcomes = asyncio.run(go())
    assert len(outcomes) == 3
    assert last["rollout/vllm_retry_total"] >= 2 and last["rollout/groups_redispatched_total"] == 0
    assert last["rollout/server_restarts_total"] == 0 and events == []  # one check each: the same process


def test_a_server_that_dies_loses_its_groups_and_rejoins_once_re_synced(vllm_server, tool_tokenizer):
    """Server B dies under its first rollout: that group is abandoned and generated again (its prompt still
    gets exactly one outcome). B comes back on the same port as a new process on its start-up weights and
    gets nothing until the "trainer" (the `on_server` listener) labels it with the published version; then it
    takes groups again. A holds its rollouts meanwhile, so the run cannot end before B is back."""
    events, after_rejoin = [], []
    rejoined = asyncio.Event()

    class Killing(WhereLoop):
        async def setup(self) -> None:
            await super().setup()
            for server in self.pool.servers:
                server.controller.cap = 2  # A's held rollouts leave B room under the bound of 4

        async def generate_one_turn(self, prompt_ids, max_tokens=None):
            if self.client.base_url == b.url and not b.killed:
                b.killed = True
                await b.die()  # under this rollout: its request finds the port closed
                asyncio.get_running_loop().call_later(1.0, lambda: asyncio.ensure_future(b.restart()))
            elif self.client.base_url == a.url and b.killed:
                await asyncio.wait_for(rejoined.wait(), 60)
            elif self.client.base_url == b.url and rejoined.is_set():
                after_rejoin.append(b.label)
            return await super().generate_one_turn(prompt_ids, max_tokens)

    def on_server(event) -> None:
        events.append(event)
        if event.state == "resync":  # what the trainer does: push, then label the server with the version
            b.label = "1"
        if event.state == "serving":
            rejoined.set()

    async def go():
        nonlocal a, b
        a, b = await ServerDouble(vllm_server.url).start(), await ServerDouble(vllm_server.url).start()
        b.killed = False
        try:
            loop = Killing(
                _config([a.url, b.url], max_concurrent_rollouts=4, concurrency_control="fixed"),
                tokenizer=tool_tokenizer, dataset=_prompts(12), reward_funcs=length_reward, max_epochs=1,
            )  # fmt: skip
            outcomes, metrics = [], []
            await loop.run(
                lambda s: None, policy_version=lambda: 1, on_group=outcomes.append, on_server=on_server,
                metrics_sink=metrics.append,
            )  # fmt: skip
            return outcomes, metrics[-1]
        finally:
            await a.stop()
            await b.stop()

    a = b = None
    outcomes, last = asyncio.run(go())
    assert sorted(o.row_index for o in outcomes) == list(range(12)), "every prompt exactly once, none lost"
    assert [(e.url, e.state) for e in events] == [(b.url, "down"), (b.url, "resync"), (b.url, "serving")]
    assert events[0].incarnation == 1 and "down" not in events[1].detail
    assert last["rollout/groups_redispatched_total"] >= 1 and last["rollout/server_restarts_total"] == 1
    assert after_rejoin and set(after_rejoin) == {"1"}, "B took groups again, and only once re-synced"
    assert last["rollout/server/1/serving"] == 1.0 and last["rollout/servers_serving"] == 2.0


def test_a_server_that_never_comes_back_ends_the_run_after_vllm_server_timeout(vllm_server, tool_tokenizer):
    """The only server dies under the first rollout and stays down: the loop retries with backoff, then fails
    with `ServerUnavailableError` naming the server and its state once `vllm_server_timeout` has passed."""

    class Dying(AsyncRolloutLoop):
        async def generate_one_turn(self, prompt_ids, max_tokens=None):
            await double.die()
            return await super().generate_one_turn(prompt_ids, max_tokens)

    async def go():
        nonlocal double
        double = await ServerDouble(vllm_server.url).start()
        loop = Dying(_config([double.url], vllm_server_timeout=3), tokenizer=tool_tokenizer, dataset=_prompts(2),
                     reward_funcs=length_reward, max_epochs=1)  # fmt: skip
        started = time.monotonic()
        try:
            with pytest.raises(ServerUnavailableError) as error:
                await loop.run(lambda s: None, policy_version=lambda: 1, on_server=lambda event: None)
            return error.value, time.monotonic() - started
        finally:
            await double.client.aclose()

    double = None
    error, waited = asyncio.run(go())
    assert f"no vLLM server has served for 3 s ({double.url}: down" in str(
        error
    ) and "vllm_server_timeout" in str(error)
    assert 3 <= waited < 30, waited
