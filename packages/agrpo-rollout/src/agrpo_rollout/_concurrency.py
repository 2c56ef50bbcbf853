"""`ConcurrencyController`: the live cap on rollouts in flight, steered by the server's `/metrics`.

Owns the rule of SPEC F-CONC and the slots rollouts acquire. Does not know what a rollout does,
nor HTTP (`poll` takes a coroutine that returns a `ServerLoad`).

The rule. Start at `KV cache tokens // max_model_len` (the requests that fit at full length, so the
first step cannot thrash), capped by the bound `max_concurrent_rollouts`. While nothing waits on the
server and KV usage stays below 0.6, raise the cap by 25% (at least +1) each time a cap's worth of
rollouts completes, up to the bound; a poll that sees waiting requests or usage >= 0.6 restarts that
count. When usage exceeds 0.8, cut the cap by 30% (at least to 1). In-flight rollouts are never
cancelled: new ones wait until the pool is under the new cap, and no further cut happens until
then. Without `/metrics` the cap stays at the bound. Preemptions are reported, never acted on: a
weight sync that resets the prefix cache preempts every running request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

from ._exceptions import ServerError
from ._server_load import ServerLoad

logger = logging.getLogger("agrpo_rollout")


class ConcurrencyController:
    """Slots for rollouts, `cap` of them at a time; `observe` and `release` move the cap."""

    RAISE_BELOW_KV = 0.6
    CUT_ABOVE_KV = 0.8
    RAISE_FACTOR = 1.25
    CUT_FACTOR = 0.7

    def __init__(self, bound: int, initial: int | None = None) -> None:
        if bound < 1:
            raise ValueError(f"bound={bound}; max_concurrent_rollouts must be >= 1")
        self.bound = bound
        self.adaptive = initial is not None
        self.cap = bound if initial is None else max(1, min(bound, initial))
        self.in_flight = 0
        self.completed_since_raise = 0
        self.cut_pending = False
        self.last_load: ServerLoad | None = None
        self._preemptions_at_flush: int | None = None
        self._changed: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self) -> None:
        """Wait for a free slot under the current cap and take it."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.in_flight < self.cap)
            self.in_flight += 1

    async def release(self) -> None:
        """Give a slot back: one rollout completed."""
        changed = self._condition()
        async with changed:
            self.in_flight -= 1
            self.completed_since_raise += 1
            self._maybe_raise()
            if self.cut_pending and self.in_flight < self.cap:
                self.cut_pending = False
            changed.notify_all()

    def _calm(self) -> bool:
        load = self.last_load
        return load is not None and load.waiting_requests == 0 and load.kv_cache_usage < self.RAISE_BELOW_KV

    def _maybe_raise(self) -> None:
        if (
            self.adaptive
            and self.cap < self.bound
            and self.completed_since_raise >= self.cap
            and self._calm()
        ):
            self.cap = min(self.bound, max(self.cap + 1, math.ceil(self.cap * self.RAISE_FACTOR)))
            self.completed_since_raise = 0

    async def observe(self, load: ServerLoad | None) -> None:
        """Apply one `/metrics` reading; None (no metrics) changes nothing."""
        if load is None or not self.adaptive:
            return
        changed = self._condition()
        async with changed:
            self.last_load = load
            if self._preemptions_at_flush is None:
                self._preemptions_at_flush = load.preemptions_total
            if not self._calm():
                self.completed_since_raise = 0
            if load.kv_cache_usage > self.CUT_ABOVE_KV and not self.cut_pending:
                self.cap = max(1, int(self.cap * self.CUT_FACTOR))
                self.cut_pending = self.in_flight >= self.cap
            self._maybe_raise()
            changed.notify_all()

    async def poll(self, read_load: Callable[[], Awaitable[ServerLoad | None]], interval_s: float) -> None:
        """Read the load every `interval_s` seconds, forever (cancel the task to stop it)."""
        while True:
            try:
                await self.observe(await read_load())
            except (
                ServerError,
                ValueError,
            ) as exc:  # unreachable or unparsable /metrics: keep the cap, retry
                logger.warning("reading /metrics failed (%s); the concurrency cap stays at %d", exc, self.cap)
            await asyncio.sleep(interval_s)

    def metrics(self) -> dict[str, float]:
        """`rollout/concurrency*` and the server gauges; preemptions count since the previous call."""
        out = {"rollout/concurrency": float(self.in_flight), "rollout/concurrency_cap": float(self.cap)}
        load = self.last_load
        if load is not None:
            previous = (
                self._preemptions_at_flush
                if self._preemptions_at_flush is not None
                else load.preemptions_total
            )
            out.update(
                {
                    "rollout/kv_cache_usage": load.kv_cache_usage,
                    "rollout/vllm_running_requests": float(load.running_requests),
                    "rollout/vllm_queued_requests": float(load.waiting_requests),
                    "rollout/vllm_preemptions_total": float(max(0, load.preemptions_total - previous)),
                }
            )
            self._preemptions_at_flush = load.preemptions_total
        return out
