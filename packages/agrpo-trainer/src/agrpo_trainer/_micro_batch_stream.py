"""`MicroBatchStream`: queued samples → staleness drop → planner → packed rows, on a background thread.

Owns the trainer's side of the queue (SPEC F-Q) up to the packed micro-batch: samples whose group
started more than `max_staleness` versions ago are dropped (`sample/dropped_stale_total`), the rest go
to `agrpo_packing.Planner` (one row per rank, token budget or fixed count), and each closed micro-batch
is packed into `PackedRow`s on this thread while the trainer runs the previous one's forward/backward.
A bounded prefetch queue (`prefetch` micro-batches) keeps the thread at most that far ahead, so a slow
trainer backs up into the rollout queue. Packing intervals are recorded so the trainer can report how
much of packing overlapped its compute (`perf/pack_overlap_frac`): measured, not assumed.

Staleness is checked twice: when a sample arrives, and when its micro-batch is handed to the trainer (a
sync may have happened while it waited in the prefetch queue); rows that hold a sample gone stale are
re-packed without it, so no trained sample is ever older than `max_staleness`.

Does not know models, losses or ranks' devices; reads samples through a source with
`next_sample_message(timeout)` (the `RolloutProcess`, or a replay of fixed samples in tests).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agrpo_packing import MicroBatch, PackedRow, PackingConfig, PackSample, Planner, TreeRow

from ._prompt_ledger import PromptLedger

_END = object()


@dataclass(kw_only=True, slots=True)
class PackedMicroBatch:
    """One micro-batch ready for the trainer: a packed row and its samples per rank."""

    rows: list[PackedRow]
    row_samples: list[list[Any]]
    """Per rank, the `RolloutSample`s of its row in order of `add` (loss terms index into it)."""
    metrics: dict[str, float]
    """`batch/*` of agrpo-packing."""

    @property
    def samples(self) -> list[Any]:
        return [s for row in self.row_samples for s in row]

    @property
    def num_loss_terms(self) -> int:
        return sum(row.num_loss_terms for row in self.rows)


def empty_micro_batch(num_ranks: int) -> PackedMicroBatch:
    """A micro-batch with nothing to train (pads the last optimizer step of a finished stream)."""
    rows = [TreeRow(0).pack() for _ in range(num_ranks)]
    return PackedMicroBatch(rows=rows, row_samples=[[] for _ in rows], metrics={})


@dataclass(slots=True)
class StreamStats:
    """Counters since the last `take_stats`."""

    dropped_stale: int = 0
    dropped_oversize: int = 0
    pack_intervals: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) perf_counter of each planning+packing burst."""
    time_in_queue_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)


class MicroBatchStream:
    """Background packer; `start`, then `next(...)` once per micro-batch, and `stop`."""

    def __init__(
        self,
        source: Any,
        packing: PackingConfig,
        ledger: PromptLedger,
        *,
        max_staleness: int,
        prefetch: int,
    ) -> None:
        self.source = source
        self.packing = packing
        self.ledger = ledger
        self.max_staleness = max_staleness
        self.policy_version = 0
        """The trainer's current version; samples older than `policy_version - max_staleness` are dropped."""
        self._ready: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stats = StreamStats()
        self._lock = threading.Lock()
        self.samples_dropped = self.tokens_dropped = 0
        """Samples (and their completion tokens) dropped since the start, stale or oversize: generated, untrained."""
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._origins: dict[int, tuple[PackSample, Any]] = {}
        """id(PackSample) -> (it, its RolloutSample), for samples inside the planner."""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agrpo-packer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def take_stats(self) -> StreamStats:
        with self._lock:
            stats, self._stats = self._stats, StreamStats()
        return stats

    def next(self, timeout_s: float, on_wait: Callable[[], None]) -> PackedMicroBatch | None:
        """The next micro-batch (None once the stream ended); `on_wait` runs between polls (health checks)."""
        while True:
            try:
                item = self._ready.get(timeout=timeout_s)
            except queue.Empty:
                item = None
            if item is None:
                if self._error is not None:
                    raise self._error
                on_wait()
                continue
            if item is _END:
                if self._error is not None:
                    raise self._error
                self._ready.put(_END)  # later calls see the end too
                return None
            batch = self.without_stale(item)
            if batch.samples:  # else every sample went stale while it waited: take the next one
                return batch

    # ---- background thread -------------------------------------------------------------------

    def _run(self) -> None:
        planner = Planner(self.packing)
        try:
            while not self._stop.is_set():
                message = self.source.next_sample_message(0.2)
                if message is None:
                    continue
                kind, sample = message
                if kind == "end":
                    tail = planner.flush()
                    if tail is not None:
                        self._emit(tail)
                    break
                self._admit(planner, sample)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer thread, which raises it
            self._error = error
        finally:
            self._put(_END)

    def _admit(self, planner: Planner, sample: Any) -> None:
        if self._is_stale(sample):
            self._drop_stale(sample)
            return
        pack_sample = PackSample(**sample.pack_fields())
        self._origins[id(pack_sample)] = (pack_sample, sample)
        dropped = planner.dropped_oversize_total
        start = time.perf_counter()
        closed = planner.add(pack_sample)
        if planner.dropped_oversize_total > dropped:
            del self._origins[id(pack_sample)]
            self.ledger.settle(sample.epoch, sample.row_index, trained=False)
            with self._lock:
                self._stats.dropped_oversize += 1
                self.samples_dropped += 1
                self.tokens_dropped += sample.num_trained
        for batch in closed:
            self._emit(batch, start)

    def _emit(self, batch: MicroBatch, start: float | None = None) -> None:
        start = time.perf_counter() if start is None else start
        packed = PackedMicroBatch(
            rows=batch.pack(),
            row_samples=[[self._origins.pop(id(s))[1] for s in row.samples] for row in batch.rows],
            metrics=batch.metrics(),
        )
        with self._lock:
            self._stats.pack_intervals.append((start, time.perf_counter()))
        self._put(packed)

    def _put(self, item: Any) -> None:
        while True:
            try:
                self._ready.put(item, timeout=0.2)
                return
            except queue.Full:
                if self._stop.is_set():
                    return

    # ---- staleness ---------------------------------------------------------------------------

    def _is_stale(self, sample: Any) -> bool:
        return self.policy_version - sample.policy_version > self.max_staleness

    def _drop_stale(self, sample: Any) -> None:
        self.ledger.settle(sample.epoch, sample.row_index, trained=False)
        with self._lock:
            self._stats.dropped_stale += 1
            self.samples_dropped += 1
            self.tokens_dropped += sample.num_trained

    def without_stale(self, batch: PackedMicroBatch) -> PackedMicroBatch:
        """The batch, with rows re-packed without samples that went stale while it waited."""
        if not any(self._is_stale(s) for s in batch.samples):
            return batch
        rows, row_samples = [], []
        for samples in batch.row_samples:
            fresh = [s for s in samples if not self._is_stale(s)]
            for s in samples:
                if self._is_stale(s):
                    self._drop_stale(s)
            row = TreeRow(self.packing.resolved_budget, share_prefixes=self.packing.share_prefixes)
            row.extend(PackSample(**s.pack_fields()) for s in fresh)  # a subset of a row that fit still fits
            rows.append(row.pack())
            row_samples.append(fresh)
        return PackedMicroBatch(rows=rows, row_samples=row_samples, metrics=batch.metrics)

    def record_trained(self, batch: PackedMicroBatch, now: float) -> None:
        """Queue time and staleness of the samples the trainer is about to train."""
        with self._lock:
            for sample in batch.samples:
                self._stats.time_in_queue_s.append(max(now - sample.enqueued_at, 0.0))
                self._stats.staleness.append(self.policy_version - sample.policy_version)
