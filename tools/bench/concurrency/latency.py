"""Where a rollout's slot time goes: the client's request latency against the engine's own latency.

Run: `uv run python -m tools.bench.concurrency.latency [--seconds 40] [--caps 8 32 128]`. One CPU vLLM server
(large KV cache, nothing preempts), the GRPO workload of `workload.py` under fixed caps. Printed per cap:
generated tokens/s, the mean client latency of one `/v1/completions` request, the mean time a rollout
holds its slot, and the engine's own mean request latency and inference time (vLLM's
`vllm:e2e_request_latency_seconds` and `vllm:request_inference_time_seconds` histograms, read before and
after the window). The difference between the client's latency and the engine's is time spent outside
the engine (the API server building the response, HTTP, the client's decode), which a client cap also
pays for. Does not sweep KV sizes (`__main__.py` does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agrpo_attention.testing import build_tokenizer, save_tiny_model
from agrpo_rollout import RolloutConfig
from agrpo_rollout.testing import VLLMServer
from tools.bench.concurrency.workload import CountingLoop, prompts, wait_idle, zero_reward

_HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:request_inference_time_seconds")


def _histogram_sums(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in ("vllm:generation_tokens_total",) or any(
                sample.name in (f"{h}_sum", f"{h}_count") for h in _HISTOGRAMS
            ):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class TimedLoop(CountingLoop):
    """The benchmark's loop, recording each request's latency and each rollout's slot time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.request_s: list[float] = []
        self.slot_s: list[float] = []

    async def generate_one_turn(self, prompt_ids, max_tokens=None):
        start = time.monotonic()
        turn = await super().generate_one_turn(prompt_ids, max_tokens)
        self.request_s.append(time.monotonic() - start)
        return turn

    async def _run_rollout(self, row, group_id):
        start = time.monotonic()
        try:
            return await super()._run_rollout(row, group_id)
        finally:
            self.slot_s.append(time.monotonic() - start)


async def _window(loop: TimedLoop, seconds: float) -> None:
    task = asyncio.ensure_future(loop.run(lambda sample: None))
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def measure_latency(url: str, tokenizer, cap: int, seconds: float) -> str:
    config = RolloutConfig(
        vllm_server_base_url=url, num_generations=8, max_completion_length=512, max_concurrent_rollouts=cap,
        concurrency_control="fixed",
    )  # fmt: skip
    loop = TimedLoop(
        config, tokenizer=tokenizer, dataset=prompts(f"l{cap:04d}x", 10_000, 24), reward_funcs=zero_reward
    )
    wait_idle(url)
    before, start = _histogram_sums(url), time.monotonic()
    asyncio.run(_window(loop, seconds))
    after, elapsed = _histogram_sums(url), time.monotonic() - start
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    count = delta.get("vllm:e2e_request_latency_seconds_count") or 1.0
    return (
        f"| {cap} | {delta['vllm:generation_tokens_total'] / elapsed:,.0f} | {statistics.fmean(loop.request_s):.2f} | "
        f"{statistics.fmean(loop.slot_s):.2f} | {delta['vllm:e2e_request_latency_seconds_sum'] / count:.2f} | "
        f"{delta['vllm:request_inference_time_seconds_sum'] / count:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--caps", type=int, nargs="+", default=[8, 32, 128])
    args = parser.parse_args()
    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-bench-latency-")))
    tokenizer = build_tokenizer()
    with VLLMServer(model_dir=model_dir, max_model_len=1024) as server:
        print("| cap | generated tok/s | client request s | slot s | engine e2e s | engine inference s |")
        print("|---|---|---|---|---|---|")
        for cap in args.caps:
            print(measure_latency(server.url, tokenizer, cap, args.seconds), flush=True)


if __name__ == "__main__":
    main()
