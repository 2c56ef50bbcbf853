"""One measured window of GRPO rollouts against one server, under one concurrency setting.

Owns the workload (distinct prompts, groups of `num_generations`, long completions, the training
default of 8 sampler log-probs), the server with a chosen KV-cache size (`SizedServer`) and the
measurement: generated tokens and preemptions are read from the server's own counters
(`vllm:generation_tokens_total`, `vllm:num_preemptions_total`) at the start and the end of a fixed
window that starts when the loop starts, so an adaptive rule pays for its ramp. Tokens the server
recomputes after a preemption are not generation tokens, so tokens/s is goodput. Does not know the
sweep or the table (`__main__.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agrpo_rollout import AsyncRolloutLoop, RolloutConfig
from agrpo_rollout.testing import VLLMServer


@dataclass(kw_only=True, slots=True)
class SizedServer(VLLMServer):
    """A dev server whose KV cache is `kv_cache_bytes` (the dev server's knob is whole GiB)."""

    kv_cache_bytes: int = 0
    """`--kv-cache-memory-bytes`; 0 keeps the dev server's `kv_cache_gib`."""
    watermark: float = 0.0
    """`--watermark`: the fraction of KV blocks vLLM keeps free when it admits a waiting or preempted request
    while others run (0, vLLM's default, admits whenever the request fits)."""

    def command(self, python):
        extra = ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)] if self.kv_cache_bytes else []
        extra += ["--watermark", str(self.watermark)] if self.watermark else []
        return [*VLLMServer.command(self, python), *extra]

    def _process_env(self) -> dict[str, str]:
        env = VLLMServer._process_env(self)
        if self.kv_cache_bytes:
            env.pop("VLLM_CPU_KVCACHE_SPACE")  # it would override --kv-cache-memory-bytes
        return env


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One column of the sweep: a fixed cap, or an adaptive rule under a bound."""

    name: str
    control: str
    """`fixed`, `goodput` or `kv_usage` (`RolloutConfig.concurrency_control`)."""
    cap: int
    """The fixed cap, or the adaptive rule's bound."""


@dataclass(kw_only=True, slots=True)
class Window:
    """What one setting achieved in one window."""

    setting: Setting
    seconds: float
    generated_tokens: int
    preemptions: int
    completed_rollouts: int
    caps: list[float] = field(default_factory=list)
    """`rollout/concurrency_cap` at each metrics push."""
    gauges: dict[str, float] = field(default_factory=dict)
    """Means over the window of the server's running and waiting requests and KV usage (sampled 1/s)."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def server_counters(url: str) -> dict[str, float]:
    """The counters and gauges this benchmark reads, summed over engines."""
    wanted = {
        "vllm:generation_tokens_total": "tokens",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def _sample_gauges(url: str, stop, out) -> None:
    """In its own process (the /metrics parse would otherwise take the loop's GIL): means of the gauges."""
    samples = []
    while not stop.wait(1.0):
        with contextlib.suppress(httpx.HTTPError):
            samples.append(server_counters(url))
    keys = ("running", "waiting", "kv_usage")
    out.put({k: statistics.fmean(s[k] for s in samples) if samples else 0.0 for k in keys})


class GaugeSampler:
    """Samples the server's gauges once a second, in a child process, between `start` and `stop`."""

    def __init__(self, url: str) -> None:
        context = multiprocessing.get_context("fork")
        self._stop, self._out = context.Event(), context.Queue()
        self._process = context.Process(target=_sample_gauges, args=(url, self._stop, self._out), daemon=True)

    def start(self) -> None:
        self._process.start()

    def stop(self) -> dict[str, float]:
        """Means of running, waiting and KV usage over the samples."""
        self._stop.set()
        means = self._out.get(timeout=60)
        self._process.join()
        return means


def wait_idle(url: str, timeout_s: float = 300.0) -> None:
    """Until the server runs and queues nothing (a cancelled loop's requests are aborted), then clear the
    prefix cache so no setting reuses another's prompts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counters = server_counters(url)
        if counters["running"] == 0 and counters["waiting"] == 0:
            break
        time.sleep(1.0)
    httpx.post(f"{url}/reset_prefix_cache", timeout=30)


def prompts(tag: str, count: int, words: int) -> list[dict]:
    """Distinct text prompts of `words` words; a fixed-width `tag` per window keeps their lengths equal
    and no window's prompts in another's prefix cache."""
    return [{"prompt": " ".join(f"{tag}{i}w{j}" for j in range(words))} for i in range(count)]


def zero_reward(completions, **_):
    return [0.0] * len(completions)


class CountingLoop(AsyncRolloutLoop):
    """The default loop, counting finished rollouts."""

    completed = 0

    async def generate_one(self, prompt, tools, group_id=0):
        rollout = await super().generate_one(prompt, tools, group_id)
        self.completed += 1
        return rollout


async def _run_window(loop: AsyncRolloutLoop, seconds: float, caps: list[float]) -> None:
    task = asyncio.ensure_future(
        loop.run(lambda sample: None, metrics_sink=lambda m: caps.append(m["rollout/concurrency_cap"]))
    )
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def measure(
    server: VLLMServer, tokenizer, setting: Setting, *, seconds: float, completion_tokens: int,
    prompt_words: int, num_generations: int, tag: str = "",
) -> Window:  # fmt: skip
    """Run `setting` for `seconds` from a standing start and read the server's counters around it."""
    config = RolloutConfig(
        vllm_server_base_url=server.url, num_generations=num_generations,
        max_completion_length=completion_tokens, max_concurrent_rollouts=setting.cap,
        concurrency_control=setting.control, metrics_interval_s=2.0, metrics_poll_interval_s=2.0,
    )  # fmt: skip
    dataset = prompts(tag, 10_000, prompt_words)
    loop = CountingLoop(config, tokenizer=tokenizer, dataset=dataset, reward_funcs=zero_reward)
    wait_idle(server.url)
    before, start, caps = server_counters(server.url), time.monotonic(), []
    sampler = GaugeSampler(server.url)
    sampler.start()
    asyncio.run(_run_window(loop, seconds, caps))
    after, elapsed = server_counters(server.url), time.monotonic() - start
    gauges = sampler.stop()
    return Window(
        setting=setting, seconds=elapsed, generated_tokens=int(after["tokens"] - before["tokens"]),
        preemptions=int(after["preemptions"] - before["preemptions"]), completed_rollouts=loop.completed,
        caps=caps, gauges=gauges,
    )  # fmt: skip
