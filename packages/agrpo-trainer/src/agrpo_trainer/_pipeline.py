"""`AsyncPipeline`: rank 0's end of the asynchronous pipeline, from the rollout process to packed micro-batches.

Owns the wiring of a sample source (the spawned `RolloutProcess`, or a replay in tests), the background
`MicroBatchStream`, the `PromptLedger` and the metrics that arrive from the rollout side, plus the two
things the trainer does with them: take the next micro-batch (waiting, with health checks, and counting
the wait as `perf/rollout_wait_s`), and settle the samples of a finished optimizer step. Also the servers'
state changes the rollout side reports (`ServerEvent`): each is logged, and a server that reports
`resync` (it restarted, or missed a push) makes `resync_due` true, which ends a wait for a micro-batch
early so the trainer can re-sync it (with one server nothing arrives until then). Does not know models,
losses, ranks or weight sync: the trainer publishes each new policy version with `set_version`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from agrpo_packing import PackingConfig

from ._dispatch_hold import DispatchHold
from ._group_guard import DroppedGroupGuard
from ._metrics import CounterDeltas, MetricWindow
from ._micro_batch_stream import MicroBatchStream, PackedMicroBatch
from ._prompt_ledger import PromptLedger

logger = logging.getLogger("agrpo_trainer")

_POLL_S = 0.5
_STARVED_S = 1.0
"""Seconds a waiting trainer gives the producer after a publish before it widens the `DispatchHold` window."""


class _ResyncDue(Exception):
    """Ends a wait for a micro-batch: a server waits for a re-sync (raised from the wait's poll)."""


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """Where a resumed run starts: from rollout_state.json (all zeros for a fresh run)."""

    start_index: int = 0
    base_epoch: int = 0
    done: frozenset[tuple[int, int]] = frozenset()
    """(epoch, row_index), run-wide epochs, already trained or empty."""
    prompts_consumed: int = 0
    resumed: bool = False
    """A checkpoint's trained position was read (False: a fresh run, or a state without a position)."""

    @property
    def start(self) -> tuple[int, int] | None:
        """The run-wide key of the first prompt the resumed loop may draw."""
        return (self.base_epoch, self.start_index) if self.resumed else None

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> ResumePoint:
        if not state or state.get("resume_from") is None:
            return cls(prompts_consumed=int((state or {}).get("prompts_consumed", 0)))
        epoch, row = state["resume_from"]
        return cls(
            start_index=int(row),
            base_epoch=int(epoch),
            done=frozenset((int(e), int(r)) for e, r in state.get("done", [])),
            prompts_consumed=int(state.get("prompts_consumed", 0)),
            resumed=True,
        )

    def loop_skip(self) -> frozenset[tuple[int, int]]:
        """`done` in the resumed loop's own epochs (counted from its start)."""
        return frozenset((e - self.base_epoch, r) for e, r in self.done if e >= self.base_epoch)


class AsyncPipeline:
    """Samples in, micro-batches out, on rank 0. `start`, `next_micro_batch`, `settle`, always `stop`."""

    def __init__(
        self,
        source: Any,
        packing: PackingConfig,
        *,
        max_staleness: int,
        prefetch: int,
        resume: ResumePoint,
        hold: DispatchHold | None = None,
        max_groups_dropped_in_a_row: int = 0,
    ) -> None:
        self.source = source
        self.group_guard = DroppedGroupGuard(max_groups_dropped_in_a_row)
        self.hold = hold if hasattr(source, "set_sample_allowance") else None
        """Holds the producer at `max_staleness` (None: it runs ahead as far as the queues let it)."""
        self._taken, self._published_at = 0, time.monotonic()
        self._trained_tokens = 0
        self.ledger = PromptLedger(
            base_epoch=resume.base_epoch,
            done=set(resume.done),
            num_consumed=resume.prompts_consumed,
            start=resume.start,
        )
        self.stream = MicroBatchStream(
            source, packing, self.ledger, max_staleness=max_staleness, prefetch=prefetch
        )
        self.window = MetricWindow()
        self._rollout_counts = CounterDeltas()
        self.rollout_wait_s = 0.0
        self.ended = False
        """The source finished (every epoch drawn) and the stream is drained."""
        self._resync: set[int] = set()
        self._held: list[PackedMicroBatch] = []

    def start(self, version: int) -> None:
        self.source.start()
        self.set_version(version)
        self.stream.start()

    def set_version(self, version: int) -> None:
        """Publish a version the server serves: new groups carry it; older samples age against it."""
        self.source.set_policy_version(version)
        self.stream.policy_version = version
        self._publish_allowance(step_running=False)

    def _publish_allowance(self, *, step_running: bool) -> None:
        """Tell the producer how far it may run ahead (`DispatchHold`), after a take or a push."""
        if self.hold is not None:
            gone = self._taken + self.stream.samples_dropped
            self.source.set_sample_allowance(self.hold.allowance(gone, step_running=step_running))
            self._published_at = time.monotonic()

    @property
    def resync_due(self) -> bool:
        """A server reported that it waits for a re-sync (`take_resync` says which)."""
        return bool(self._resync)

    def take_resync(self) -> set[int]:
        """The servers (indices in `vllm_server_base_url`) that reported `resync` since the last call."""
        servers, self._resync = self._resync, set()
        return servers

    def next_micro_batch(self) -> PackedMicroBatch | None:
        """The next packed micro-batch, or None once the stream ended (`ended`) or while a server waits for a
        re-sync (`resync_due`); raises if the rollout side failed."""
        start = time.perf_counter()
        try:
            batch = None if self.resync_due else self.stream.next(_POLL_S, on_wait=self._wait_poll)
        except _ResyncDue:
            batch = None
        self.rollout_wait_s += time.perf_counter() - start
        self.poll()
        if batch is None:
            self.ended = not self.resync_due  # a wait cut short by a re-sync is not the end
        else:
            self.stream.record_trained(batch, time.time())
        return batch

    def _wait_poll(self) -> None:
        waited = time.monotonic() - self._published_at > _STARVED_S
        if self.hold is not None and waited and self.source.producer_held():
            self.hold.starved()  # the producer is held below what this step needs
            self._publish_allowance(step_running=False)
        self.poll()
        if self.resync_due:
            raise _ResyncDue

    def poll(self) -> None:
        """Absorb group outcomes, server events and rollout metrics; raise if the worker failed or went silent,
        or if too many groups in a row were dropped for their rewards (`DroppedGroupGuard`)."""
        for kind, value in self.source.drain_events():
            if kind == "draw":
                self.ledger.record_draw(*value)
            elif kind == "group":
                self.ledger.record_outcome(value)
                self.group_guard.observe(value)
            elif kind == "server":
                self._server_event(value)
            elif kind == "metrics":  # the loop's running totals, as counts since its previous push
                self.window.add(self._rollout_counts(value))
        self.source.check()

    def _server_event(self, event) -> None:
        if event.state == "resync":
            self._resync.add(event.index)
            logger.warning(
                "vLLM server %s needs a re-sync (%s): the trainer pushes its weights to every server as the next "
                "version before that server takes groups again", event.url, event.detail,
            )  # fmt: skip
        elif event.state in ("down", "lost"):
            logger.warning(
                "vLLM server %s is %s (%s): its groups in flight are generated again on a server that serves",
                event.url, "lost (no answer for vllm_server_timeout)" if event.state == "lost" else "down", event.detail,
            )  # fmt: skip
        else:
            logger.info("vLLM server %s is %s", event.url, event.state)

    def take_step(
        self, num_batches: int, *, behind: Callable[[set[int]], bool]
    ) -> list[PackedMicroBatch] | None:
        """Up to `num_batches` micro-batches for one step (fewer only at the end, none once ended), or None
        when a server that reported `resync` is `behind` and must be re-synced first: the batches taken so
        far are kept for the next call, which drops what the new version made stale."""
        batches = [b for b in map(self.stream.without_stale, self._held) if b.samples]
        self._held = []
        while True:
            while len(batches) < num_batches and not self.resync_due:
                if (batch := self.next_micro_batch()) is None:
                    break
                batches.append(batch)
            servers = self.take_resync()
            if servers and behind(servers):
                self._held = batches
                return None
            if len(batches) >= num_batches or self.ended:
                self._taken += sum(len(b.samples) for b in batches)
                self._publish_allowance(step_running=True)
                return batches

    def settle(self, batches: list[PackedMicroBatch]) -> None:
        """The samples of a finished optimizer step are trained."""
        if self.hold is not None:
            self.hold.observe_step(sum(len(b.samples) for b in batches))
        self._trained_tokens += sum(s.num_trained for b in batches for s in b.samples)
        for batch in batches:
            for sample in batch.samples:
                self.ledger.settle(sample.epoch, sample.row_index, trained=True)

    def take_metrics(self) -> dict[str, float]:
        """Rollout-side metrics since the last call, with the stream's `sample/*` and packing overlap inputs."""
        out = self.window.reduce()
        stats = self.stream.take_stats()
        out["sample/dropped_stale_total"] = float(stats.dropped_stale)
        out["batch/dropped_oversize_total"] = float(stats.dropped_oversize)
        out["sample/wasted_token_frac"] = self.stream.tokens_dropped / max(self._trained_tokens, 1)
        if stats.time_in_queue_s:
            out["sample/time_in_queue_s"] = float(np.mean(stats.time_in_queue_s))
            out["sample/staleness_mean"] = float(np.mean(stats.staleness))
            out["sample/staleness_max"] = float(np.max(stats.staleness))
        queue_size = getattr(self.source, "queue_size", None)
        if queue_size is not None:
            out["sample/rollout_queue_size"] = float(queue_size())
        out["perf/rollout_wait_s"] = self.rollout_wait_s
        self.rollout_wait_s = 0.0
        self._pack_intervals = stats.pack_intervals
        out["perf/pack_s"] = sum(end - start for start, end in stats.pack_intervals)
        return out

    def pack_intervals(self) -> list[tuple[float, float]]:
        """The packing bursts of the last `take_metrics` window (perf_counter seconds)."""
        return getattr(self, "_pack_intervals", [])

    def stop(self) -> None:
        self.stream.stop()
        self.source.stop()
