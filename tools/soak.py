"""The soak: hundreds of concurrent multi-turn rollouts with a slow async tool, through random network faults,
for minutes, checking that nothing leaks and nothing is lost (issue 13, point 4).

Owns the run and its invariants. A `SoakLoop` (agrpo-rollout's `AsyncRolloutLoop`: each rollout samples a
few real tokens from the server, then calls the `lookup` tool, an async tool that sleeps, then samples its
answer) runs round after round against a real vLLM server behind a `FaultProxy` that answers 500, drops
the connection or delays a share of sampling requests. Each round is one `run(max_groups=...)` of a fresh
loop with a fixed concurrency cap (`--concurrency`, 256 by default). Checked, and reported:

- nothing lost: every drawn prompt (`on_draw`) gets exactly one `on_group` outcome, and every kept
  group's samples all reached the sink, none twice, none from a group that was not kept;
- no leak: asyncio tasks, threads, open file descriptors and child processes of this process, counted
  before the first round, after the warm-up round(s) and after the last round, return to the warm count
  (threads leave out the event loop's default executor, which grows lazily to a fixed bound);
- memory flat: RSS sampled every second; after warm-up it may not grow by more than `--rss-bound-mb`
  (the largest RSS of the last third of the run against the largest of the first third after warm-up).

Run: `uv run python -m tools.soak --minutes 8` (starts a CPU vLLM server on a tiny model, about a minute,
then soaks), or `--url http://127.0.0.1:PORT` to use a running server of the tiny tool-template model.
Prints a summary and one JSON line; exits 1 when an invariant fails. `tests/test_soak.py` runs a short
soak against the test session's server. Results: `docs/reliability.md`. Does not train (the trainer's own
fault tests are `packages/agrpo-trainer/tests/test_faults.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil

from agrpo_attention.testing import build_tokenizer, save_tiny_model
from agrpo_rollout import AsyncRolloutLoop, GroupOutcome, RolloutConfig
from agrpo_rollout.testing import VLLMServer, scripted_turn
from tools.fault_proxy import FaultMix, FaultProxy

_SETTLE_S = 10.0


@dataclass(kw_only=True)
class SoakSettings:
    """One soak run: its length, load and faults."""

    minutes: float = 8.0
    concurrency: int = 256
    """Rollouts in flight (a fixed cap: `concurrency_control="fixed"`)."""
    num_generations: int = 8
    groups_per_round: int = 64
    warmup_rounds: int = 1
    error_rate: float = 0.03
    """Share of sampling requests answered 500 by the proxy; `drop_rate` closes the connection unanswered."""
    drop_rate: float = 0.03
    slow_rate: float = 0.05
    """Share of sampling requests held 0.5-2 s before they are forwarded."""
    tool_delay_s: tuple[float, float] = (0.2, 1.0)
    rss_bound_mb: float = 64.0
    seed: int = 0


class SlowLookup:
    """The soak's async tool: answers after a random delay, on the event loop (no thread)."""

    def __init__(self, delay_s: tuple[float, float], seed: int) -> None:
        self.delay_s, self._random, self.calls = delay_s, random.Random(seed), 0

    async def lookup(self, query: str) -> str:
        """Look a query up in a slow remote index.

        Args:
            query: What to look up.
        """
        self.calls += 1
        await asyncio.sleep(self._random.uniform(*self.delay_s))
        return f"{query}: found"


class InFlight:
    """Counts rollouts in flight: the most seen, and the mean over the seconds sampled."""

    def __init__(self) -> None:
        self.now, self.most, self.samples = 0, 0, []

    def enter(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)

    def leave(self) -> None:
        self.now -= 1


class SoakLoop(AsyncRolloutLoop):
    """First turn: up to 3 real sampled tokens that read as plain text, then a scripted `lookup` call (context
    only: a random tiny model never writes a well-formed call); after the tool's answer, a real turn."""

    script = '<tool_call>\n{"name": "lookup", "arguments": {"query": "weather"}}\n</tool_call>'
    gauge: InFlight

    async def generate_one(self, prompt, tools, group_id=0):
        self.gauge.enter()
        try:
            return await super().generate_one(prompt, tools, group_id)
        finally:
            self.gauge.leave()

    async def generate_one_turn(self, prompt_ids, max_tokens=None):
        real = await super().generate_one_turn(prompt_ids, max_tokens=min(3, max_tokens or 3))
        if self.tokenizer.convert_tokens_to_ids("<tool_response>") in prompt_ids:
            return real
        return scripted_turn(self.tokenizer, real, self.script)


def text_length(completions, **columns) -> list[float]:
    """Characters of each completion's last message: spread within a group, so most groups are kept."""
    return [float(len(str(c[-1]["content"] if isinstance(c, list) else c))) for c in completions]


@dataclass(frozen=True)
class Resources:
    """What this process holds: asyncio tasks (besides the soak's own), threads, open fds, children."""

    tasks: int
    threads: int
    fds: int
    children: int

    @classmethod
    def now(cls, own_tasks: int) -> Resources:
        """Threads leave out the event loop's default executor (`asyncio_<n>`: getaddrinfo and `to_thread`
        run there), which starts workers lazily up to its fixed `max_workers`: bounded, so not a leak."""
        me = psutil.Process()
        tasks = len(asyncio.all_tasks()) - own_tasks
        threads = sum(not t.name.startswith("asyncio_") for t in threading.enumerate())
        return cls(tasks, threads, me.num_fds(), len(me.children(recursive=True)))


class RoundLedger:
    """One round's accounting: draws, outcomes and samples, and whatever does not add up."""

    def __init__(self) -> None:
        self.drawn: Counter[tuple[int, int]] = Counter()
        self.outcomes: dict[tuple[int, int], list[GroupOutcome]] = {}
        self.samples: Counter[int] = Counter()

    def on_draw(self, row_index: int, epoch: int) -> None:
        self.drawn[(epoch, row_index)] += 1

    def on_group(self, outcome: GroupOutcome) -> None:
        self.outcomes.setdefault((outcome.epoch, outcome.row_index), []).append(outcome)

    def sink(self, sample) -> None:
        self.samples[sample.group_id] += 1

    def problems(self) -> list[str]:
        """Every way this round lost or duplicated something (empty when all adds up)."""
        out = [f"prompt {k} drawn {n} times" for k, n in self.drawn.items() if n != 1]
        out += [f"prompt {k} drawn, no outcome" for k in self.drawn if k not in self.outcomes]
        out += [f"prompt {k}: {len(v)} outcomes" for k, v in self.outcomes.items() if len(v) != 1]
        kept = {o.group_id: o for v in self.outcomes.values() for o in v if o.kept}
        out += [f"outcome for {k} never drawn" for k, v in self.outcomes.items()
                if k not in self.drawn and v[0].reason != "filtered"]  # fmt: skip
        out += [f"group {g}: {self.samples[g]} samples, outcome says {o.num_samples}"
                for g, o in kept.items() if self.samples[g] != o.num_samples]  # fmt: skip
        out += [f"group {g}: {n} samples but not kept" for g, n in self.samples.items() if g not in kept]
        return out


@dataclass(kw_only=True)
class SoakReport:
    """What a soak saw; `problems` lists every failed invariant."""

    settings: SoakSettings
    rounds: int = 0
    duration_s: float = 0.0
    prompts: int = 0
    outcomes: Counter = field(default_factory=Counter)
    samples: int = 0
    tool_calls: int = 0
    retries: int = 0
    faults: Counter = field(default_factory=Counter)
    most_in_flight: int = 0
    mean_in_flight: float = 0.0
    resources: dict[str, Resources] = field(default_factory=dict)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since start, RSS MB), one per second."""
    warm_at_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def rss_growth_mb(self) -> float:
        """Largest RSS of the last third after warm-up minus the largest of the first third."""
        warm = [mb for t, mb in self.rss_mb if t >= self.warm_at_s]
        if len(warm) < 3:
            return 0.0
        third = len(warm) // 3
        return max(warm[-third:]) - max(warm[:third])

    def check(self) -> list[str]:
        """The invariants over the whole run, appended to `problems` (and returned)."""
        warm, after = self.resources.get("warm"), self.resources.get("after")
        if warm and after:
            for name in ("tasks", "threads", "fds", "children"):
                if getattr(after, name) > getattr(warm, name):
                    self.problems.append(
                        f"{name}: {getattr(warm, name)} after warm-up, {getattr(after, name)} at the end"
                        + (f" ({sorted(t.name for t in threading.enumerate())})" if name == "threads" else "")
                    )
        if after and after.tasks:
            self.problems.append(f"{after.tasks} asyncio tasks left after the last round")
        if self.rss_growth_mb() > self.settings.rss_bound_mb:
            self.problems.append(
                f"RSS grew {self.rss_growth_mb():.1f} MB after warm-up (bound {self.settings.rss_bound_mb} MB)"
            )
        return self.problems

    def summary(self) -> str:
        res = " ".join(f"{k}={v.tasks}/{v.threads}/{v.fds}/{v.children}" for k, v in self.resources.items())
        rss = [mb for _, mb in self.rss_mb]
        return "\n".join([
            f"soak: {self.rounds} rounds in {self.duration_s:.0f} s, {self.prompts} prompts x "
            f"{self.settings.num_generations} rollouts, {self.samples} samples, {self.tool_calls} tool calls",
            f"  in flight     {self.most_in_flight} most, {self.mean_in_flight:.0f} mean (cap {self.settings.concurrency})",
            f"  outcomes      {dict(self.outcomes)}",
            f"  faults        {dict(self.faults)}; client retries {self.retries}",
            f"  resources     tasks/threads/fds/children {res}",
            f"  RSS           {min(rss, default=0):.0f}-{max(rss, default=0):.0f} MB, growth after warm-up "
            f"{self.rss_growth_mb():.1f} MB (bound {self.settings.rss_bound_mb:.0f})",
            f"  problems      {self.problems or 'none'}",
        ])  # fmt: skip


async def _sample_rss(report: SoakReport, gauge: InFlight, start: float) -> None:
    me = psutil.Process()
    while True:
        report.rss_mb.append((time.monotonic() - start, me.memory_info().rss / 2**20))
        gauge.samples.append(gauge.now)
        await asyncio.sleep(1.0)


async def _settled(target: Resources | None, own_tasks: int) -> Resources:
    """Resources once the finished round's threads and sockets had time to close: as soon as they are back
    to `target`, else once they held still for 2 s, at most `_SETTLE_S` after the round."""
    deadline, history = time.monotonic() + _SETTLE_S, []
    while True:
        now = Resources.now(own_tasks)
        history.append(now)
        back = target is not None and all(
            a <= b for a, b in zip(asdict(now).values(), asdict(target).values(), strict=True)
        )
        still = len(history) >= 8 and len(set(history[-8:])) == 1
        if back or still or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.25)


async def _round(url: str, settings: SoakSettings, tokenizer, gauge: InFlight, tool: SlowLookup, index: int):
    config = RolloutConfig(
        vllm_server_base_url=url, num_generations=settings.num_generations, max_completion_length=48,
        max_concurrent_rollouts=settings.concurrency, concurrency_control="fixed", vllm_max_retries=12,
        vllm_retry_backoff_s=0.05, vllm_server_timeout=120.0, metrics_interval_s=1.0,
        metrics_poll_interval_s=1.0,
    )  # fmt: skip
    dataset = [{"prompt": [{"role": "user", "content": f"Look up item {index}-{i}."}]} for i in range(32)]
    loop = SoakLoop(
        config, tokenizer=tokenizer, dataset=dataset, reward_funcs=text_length, tools=[tool.lookup]
    )
    loop.gauge = gauge
    ledger, metrics = RoundLedger(), []
    await loop.run(ledger.sink, on_group=ledger.on_group, on_draw=ledger.on_draw,
                   metrics_sink=metrics.append, max_groups=settings.groups_per_round)  # fmt: skip
    return ledger, metrics[-1] if metrics else {}


async def soak(url: str, settings: SoakSettings) -> SoakReport:
    """Rounds until `settings.minutes` have passed; the report of what every round saw."""
    report, gauge = SoakReport(settings=settings), InFlight()
    tokenizer, tool = build_tokenizer(template="tools"), SlowLookup(settings.tool_delay_s, settings.seed)
    policy = FaultMix(error_500=settings.error_rate, drop=settings.drop_rate, slow=settings.slow_rate,
                      seed=settings.seed)  # fmt: skip
    start = time.monotonic()
    sampler = asyncio.ensure_future(_sample_rss(report, gauge, start))
    own = 2  # this coroutine's task and the sampler
    with FaultProxy(url, policy, upstream_keepalive=False) as proxy:
        report.resources["before"] = Resources.now(own)
        while report.rounds < settings.warmup_rounds or time.monotonic() - start < settings.minutes * 60:
            ledger, metrics = await _round(proxy.url, settings, tokenizer, gauge, tool, report.rounds)
            report.problems += [f"round {report.rounds}: {p}" for p in ledger.problems()]
            report.rounds += 1
            report.prompts += sum(ledger.drawn.values())
            report.outcomes.update(o[0].reason or "kept" for o in ledger.outcomes.values())
            report.samples += sum(ledger.samples.values())
            report.retries += int(metrics.get("rollout/vllm_retry_total", 0))
            key = "warm" if report.rounds == settings.warmup_rounds else "after"
            report.resources[key] = await _settled(report.resources.get("warm"), own)
            report.warm_at_s = report.warm_at_s or (time.monotonic() - start if key == "warm" else 0.0)
        report.faults = Counter(proxy.counts)
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    report.duration_s = time.monotonic() - start
    report.tool_calls, report.most_in_flight = tool.calls, gauge.most
    report.mean_in_flight = float(np.mean(gauge.samples)) if gauge.samples else 0.0
    report.resources.setdefault("after", report.resources["warm"])
    report.check()
    return report


def run_soak(url: str, settings: SoakSettings) -> SoakReport:
    """`soak` on a fresh event loop (what the command line and the test call)."""
    return asyncio.run(soak(url, settings))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--url", default="", help="a running server of the tiny tool-template model")
    parser.add_argument("--error-rate", type=float, default=0.03)
    parser.add_argument("--drop-rate", type=float, default=0.03)
    parser.add_argument("--slow-rate", type=float, default=0.05)
    parser.add_argument("--rss-bound-mb", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = SoakSettings(
        minutes=args.minutes, concurrency=args.concurrency, error_rate=args.error_rate, drop_rate=args.drop_rate,
        slow_rate=args.slow_rate, rss_bound_mb=args.rss_bound_mb, seed=args.seed,
    )  # fmt: skip
    if args.url:
        report = run_soak(args.url, settings)
    else:
        model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="agrpo-soak-")))
        with VLLMServer(model_dir=model_dir) as server:
            print(f"server {server.url} ({model_dir})", file=sys.stderr)
            report = run_soak(server.url, settings)
    print(report.summary())
    line = {"rounds": report.rounds, "duration_s": round(report.duration_s, 1), "prompts": report.prompts,
            "samples": report.samples, "problems": report.problems, "rss_growth_mb": round(report.rss_growth_mb(), 1),
            "resources": {k: asdict(v) for k, v in report.resources.items()}, "faults": dict(report.faults),
            "retries": report.retries, "most_in_flight": report.most_in_flight,
            "mean_in_flight": round(report.mean_in_flight, 1)}  # fmt: skip
    print(json.dumps(line))
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
