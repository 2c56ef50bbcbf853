"""`ConcurrencyController`: the live cap on rollouts in flight, steered by the server's `/metrics`.

Owns the slots rollouts acquire, the bound, the readings of `/metrics` and what every rule shares (one
controller per server: the loop's `ServerPool` polls each server and feeds its controller; `poll` is the
same loop for a controller used on its own); the rules themselves (when the cap rises or falls) are in `_cap_rules.py`: `goodput` (default) or
`kv_usage` (the reference's, SPEC F-CONC). Does not know what a rollout does, nor HTTP (`poll` takes a
coroutine that returns a `ServerLoad`).

Shared by every rule: the cap starts at `KV cache tokens // max_model_len` (the requests that fit at
full length, so the first step cannot thrash), within [1, `max_concurrent_rollouts`]; it never leaves
that range. In-flight rollouts are never cancelled: after a cut, new ones wait until the pool is under
the new cap, and no further cut happens until then. Without `/metrics` (or with `fixed`) the cap stays
at the bound. `rollout/vllm_preemptions_total` counts the server's preemptions since the controller's
first reading (a running total, like every `*_total`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ._cap_rules import CAP_RULES, CapRule
from ._exceptions import ServerError
from ._server_load import ServerLoad

logger = logging.getLogger("agrpo_rollout")


class ConcurrencyController:
    """Slots for rollouts, `cap` of them at a time; `observe` and `release` move the cap by `rule`."""

    def __init__(
        self, bound: int, initial: int | None = None, *, rule: str = "goodput", watermark: float = 0.0
    ) -> None:
        if bound < 1:
            raise ValueError(f"bound={bound}; max_concurrent_rollouts must be >= 1")
        if rule not in CAP_RULES:
            raise ValueError(f"rule={rule!r}; use one of {sorted(CAP_RULES)}")
        self.bound = bound
        self.watermark = watermark
        """The server's `--watermark` (`ServerInfo.watermark`; 0 when none or unknown), read by the rules."""
        self.rule: CapRule | None = None if initial is None else CAP_RULES[rule]()
        self.cap = bound if initial is None else max(1, min(bound, initial))
        self.in_flight = 0
        self.cut_pending = False
        self.last_load: ServerLoad | None = None
        self._preemptions_at_start: int | None = None
        self._preemptions_before = 0
        """Preemptions counted on earlier processes of the server (a restart resets its counter)."""
        self._changed: asyncio.Condition | None = None

    @property
    def adaptive(self) -> bool:
        return self.rule is not None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _set_cap(self, cap: int) -> None:
        """Apply a rule's cap within [1, bound]; a cut waits until the pool drained under the last one."""
        cap = max(1, min(self.bound, cap))
        if cap < self.cap:
            if self.cut_pending:
                return
            self.cut_pending = self.in_flight >= cap
        self.cap = cap

    @property
    def has_room(self) -> bool:
        """Whether a slot is free under the current cap."""
        return self.in_flight < self.cap

    def try_acquire(self) -> bool:
        """Take a slot if one is free now (a `ServerPool` choosing among servers); False otherwise."""
        if not self.has_room:
            return False
        self.in_flight += 1
        return True

    def forget_process(self) -> None:
        """The server restarted: its counters start again, so readings restart from here (the running
        preemption total carries on) and the rule's deltas never span two processes."""
        if self.last_load is not None and self._preemptions_at_start is not None:
            self._preemptions_before += max(0, self.last_load.preemptions_total - self._preemptions_at_start)
        self.last_load, self._preemptions_at_start = None, None

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
            if self.rule is not None:
                self._set_cap(self.rule.on_release(self))
            if self.cut_pending and self.in_flight < self.cap:
                self.cut_pending = False
            changed.notify_all()

    async def observe(self, load: ServerLoad | None) -> None:
        """Apply one `/metrics` reading; None (no metrics) changes nothing."""
        if load is None:
            return
        changed = self._condition()
        async with changed:
            previous, self.last_load = self.last_load, load
            if self._preemptions_at_start is None:
                self._preemptions_at_start = load.preemptions_total
            if self.rule is not None:
                self._set_cap(self.rule.on_load(self, load, previous))
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
        """`rollout/concurrency*` and the server gauges; preemptions count since the first reading."""
        out = {"rollout/concurrency": float(self.in_flight), "rollout/concurrency_cap": float(self.cap)}
        load = self.last_load
        if load is not None:
            out.update(
                {
                    "rollout/kv_cache_usage": load.kv_cache_usage,
                    "rollout/vllm_running_requests": float(load.running_requests),
                    "rollout/vllm_queued_requests": float(load.waiting_requests),
                    "rollout/vllm_preemptions_total": float(
                        self._preemptions_before + max(0, load.preemptions_total - self._preemptions_at_start)
                    ),
                }
            )
        return out
