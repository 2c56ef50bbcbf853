"""The rules that move the live concurrency cap: `GoodputRule` (the default) and `KVUsageRule` (the reference's).

Owns when a cap rises or falls, given `/metrics` readings (`on_load`) and completed rollouts
(`on_release`). A rule returns the cap it wants; `ConcurrencyController` (`_concurrency.py`) owns the
slots, the bound and the one rule they share: a cut waits until the pool has drained under the last
cut, since in-flight rollouts are never cancelled. Does not know HTTP or what a rollout does. Adding a
rule is one class here and one entry in `CAP_RULES`.

`KVUsageRule` (SPEC F-CONC, `concurrency_control="kv_usage"`): while nothing waits on the server and
KV usage stays below 0.6, raise the cap by 25% (at least +1) each time a cap's worth of rollouts
completes; a reading with waiting requests or usage >= 0.6 restarts that count; usage above 0.8 cuts
the cap by 30%. Against a server whose KV cache holds only a few full-length requests it cut
preemptions 4-26x but lost 1.5-3.6x throughput to a fixed cap of 128 (issue 10): it starts at the
full-length fit, while real sequences are much shorter, and 0.6 leaves the cache half idle.

`GoodputRule` (`concurrency_control="goodput"`) probes for the most requests the server can use,
the way TCP probes a link. vLLM admits queued requests whenever their prompt fits (no reserve for
growth) and, when its KV cache is full, preempts the newest running request, which later recomputes
its prefix: an occasional preemption is cheap, constant preemption is thrashing. So the overload
signal is a reading with more than `PREEMPTIONS_PER_COMPLETION` preemptions per rollout completed
since the previous reading; it cuts the cap to `CUT_FACTOR` of itself. Otherwise a limiting cap
rises: doubling per reading (`SLOW_START`) while nothing waits on the server, then, once requests
have queued or the server was overloaded, by `1 + cap/8` per quarter cap's worth of completions, so
each step's effect shows before the next. KV usage is not a signal (a full cache is what a busy
server has), and a short queue is welcome: it keeps the engine busy while finished requests travel
back to the client and new ones arrive. A jump of preemptions out of a quiet reading that covers at
least 3/4 of the requests that were running is a prefix-cache reset (a weight sync's `/pause` with
`clear_cache`, agrpo-sync's default), not overload; a second such reading in a row is thrashing. Against
a large KV cache nothing preempts, and the cap (which starts at the full-length fit, there the
bound) stays at the bound like a fixed cap. Measured against a sweep of fixed caps on small- and
large-KV CPU servers: `tools/bench/concurrency`.

On a server started with `--watermark` (vLLM keeps that fraction of KV blocks free when it admits a
waiting request while others run) the admission reserve the rule stands in for is the server's own:
the cap starts at the bound (`ServerInfo.initial_concurrency`) and only constant preemption
(`PREEMPTIONS_PER_COMPLETION_RESERVED`) cuts it. That is the configuration the start-up check recommends
for a KV cache that holds fewer full-length requests than the bound.
"""

from __future__ import annotations

import math
from typing import Protocol

from ._server_load import ServerLoad


class CapState(Protocol):
    """What a rule reads of the slots it advises; `ConcurrencyController` implements it (this module owns the
    interface, so the controller imports the rules and not the other way round)."""

    cap: int
    bound: int
    in_flight: int
    cut_pending: bool
    watermark: float
    """The server's `--watermark` (KV blocks it keeps free when admitting a waiting request); 0: none or unknown."""


class CapRule(Protocol):
    """What a rule answers: the cap it wants after a `/metrics` reading or a completed rollout."""

    def on_load(self, controller: CapState, load: ServerLoad, previous: ServerLoad | None) -> int:
        """The cap after a reading (`previous` is the reading before it, None at first)."""
        ...

    def on_release(self, controller: CapState) -> int:
        """The cap after a rollout completed."""
        ...


class KVUsageRule:
    """The reference's rule (SPEC F-CONC); see the module docstring."""

    RAISE_BELOW_KV = 0.6
    CUT_ABOVE_KV = 0.8
    RAISE_FACTOR = 1.25
    CUT_FACTOR = 0.7

    def __init__(self) -> None:
        self.completed_since_raise = 0
        self._calm = False

    def _maybe_raise(self, controller: CapState) -> int:
        cap = controller.cap
        if self._calm and cap < controller.bound and self.completed_since_raise >= cap:
            self.completed_since_raise = 0
            return max(cap + 1, math.ceil(cap * self.RAISE_FACTOR))
        return cap

    def on_release(self, controller: CapState) -> int:
        self.completed_since_raise += 1
        return self._maybe_raise(controller)

    def on_load(self, controller: CapState, load: ServerLoad, previous: ServerLoad | None) -> int:
        self._calm = load.waiting_requests == 0 and load.kv_cache_usage < self.RAISE_BELOW_KV
        if not self._calm:
            self.completed_since_raise = 0
        if load.kv_cache_usage > self.CUT_ABOVE_KV and not controller.cut_pending:
            return max(1, int(controller.cap * self.CUT_FACTOR))
        return self._maybe_raise(controller)


class GoodputRule:
    """Raise the cap until the server preempts more than it can afford; see the module docstring."""

    SLOW_START = 2.0
    CUT_FACTOR = 0.85
    PREEMPTIONS_PER_COMPLETION = 0.2
    """Preemptions a reading may show per rollout completed since the previous one before it counts as
    overload (a preempted request recomputes its prefix: cheap once in a while, thrashing when constant)."""
    PREEMPTIONS_PER_COMPLETION_RESERVED = 1.0
    """The same on a server started with `--watermark`: its admission keeps room for running requests to
    grow, so a deep queue there is what keeps it busy, and only constant preemption (one per rollout) is
    overload. Measured on a small-KV CPU server (`tools/bench/concurrency`, docs/benchmarks.md): at
    `--watermark 0.1`-`0.2` the bound's 128 requests preempted 0.1-0.5 times per rollout, at 0.8-1.0x the
    tokens/s of the fastest fixed cap on the server without the reserve."""
    BINDING = 0.75
    """A cap counts as limiting when at least this fraction of it is in flight; otherwise raising it
    changes nothing now and would release a burst later."""

    def __init__(self) -> None:
        self.saturated = False
        self.completed_since_reading = 0
        self.completed_since_change = 0
        self.preempted_before = 0

    def on_release(self, controller: CapState) -> int:
        self.completed_since_reading += 1
        self.completed_since_change += 1
        return controller.cap

    def on_load(self, controller: CapState, load: ServerLoad, previous: ServerLoad | None) -> int:
        cap, completed = controller.cap, self.completed_since_reading
        self.completed_since_reading = 0
        if previous is None:
            return cap
        preempted = load.preemptions_total - previous.preemptions_total
        quiet_before, self.preempted_before = self.preempted_before == 0, preempted
        cache_reset = quiet_before and preempted >= max(2, 0.75 * previous.running_requests)
        reserved = controller.watermark > 0
        limit = self.PREEMPTIONS_PER_COMPLETION_RESERVED if reserved else self.PREEMPTIONS_PER_COMPLETION
        if preempted > limit * completed and not cache_reset:
            self.saturated, self.completed_since_change = True, 0
            return max(1, int(cap * self.CUT_FACTOR))
        self.saturated = self.saturated or load.waiting_requests > 0
        if completed == 0 or controller.in_flight < self.BINDING * cap:
            return cap
        if not self.saturated:
            self.completed_since_change = 0
            return max(cap + 1, math.ceil(cap * self.SLOW_START))
        if self.completed_since_change < max(1, cap // 4):
            return cap
        self.completed_since_change = 0
        return cap + 1 + cap // 8


CAP_RULES: dict[str, type] = {"goodput": GoodputRule, "kv_usage": KVUsageRule}
"""`RolloutConfig.concurrency_control` names (besides `fixed`, which uses no rule)."""
