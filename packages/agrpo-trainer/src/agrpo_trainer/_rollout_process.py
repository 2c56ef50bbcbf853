"""`RolloutProcess`: the rollout loop in a spawned CPU process, and the trainer's end of it (SPEC F-PROC).

Owns the process boundary: what crosses it is `_rollout_handoff.py`'s; here are the channels (a bounded sample queue, an unbounded
event queue for drawn prompts, group outcomes, server state changes (`ServerEvent`: the trainer re-syncs a
server that reports `resync`), metrics and the worker's traceback, a shared policy version, a
wall-clock heartbeat, a stop event), health checks, and shutdown that leaves no process behind (the
worker, then multiprocessing's resource tracker if this object started it). Does not know what a sample
means (the trainer's `SampleStream`) nor how the loop generates (agrpo-rollout).

The child starts with `CUDA_VISIBLE_DEVICES=""` and no torchrun variables, set in its environment before
it imports anything, so a reward model that asks for a GPU runs on CPU there. Its heartbeat is written by
every push of the loop's `metrics_sink` and, between pushes (and before the first, while the loop probes
the server), by a task on the loop's own event loop every second: a stuck event loop stops both, a slow
trainer neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agrpo_sync import settle_interrupted_sync

from ._dispatch_hold import IssuedSamples
from ._exceptions import RolloutWorkerError
from ._rollout_handoff import RolloutHandoff, pickle_handoff

logger = logging.getLogger("agrpo_trainer")

# torchrun/accelerate variables that would make the child think it is a distributed rank.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")  # fmt: skip
_HEARTBEAT_PERIOD_S = 1.0
_STARTUP_TIMEOUT_S = 300.0
"""Seconds the child may take to import and unpickle before its first heartbeat."""


@dataclass(frozen=True, kw_only=True)
class _Channels:
    samples: Any
    events: Any
    version: Any
    heartbeat: Any
    stop: Any
    sample_allowance: Any
    """Samples the producer may have issued in all (`DispatchHold`): groups beyond it wait."""
    held: Any
    """1 while the producer waits for a larger allowance."""


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """The spawned child inherits os.environ at start: no GPU, not a distributed rank."""
    saved = dict(os.environ)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for name in list(os.environ):
        if name in _RANK_VARIABLES or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _put(channel: Any, item: Any, stop: Any) -> bool:
    """Blocking put that gives up once `stop` is set (then the item is dropped: the run is ending)."""
    while not stop.is_set():
        try:
            channel.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


async def _run_loop(loop: Any, ch: _Channels, sync_journal: str | None = None) -> None:
    main = asyncio.current_task()
    event_loop = asyncio.get_running_loop()

    def watch_stop() -> None:
        # Polled, never `wait()`ed: a process that dies inside Event.wait leaves the event's condition
        # expecting its acknowledgement, and the trainer's `set()` would then block forever.
        while not ch.stop.is_set():
            time.sleep(0.1)
        with contextlib.suppress(RuntimeError):  # the loop already ended (and closed): nothing to cancel
            event_loop.call_soon_threadsafe(main.cancel)

    def watch_parent() -> None:  # a trainer killed with SIGKILL never calls stop(): do not outlive it
        parent = mp.parent_process()
        mp.connection.wait([parent.sentinel])
        if sync_journal:  # nobody else would resume a server its sync left paused
            try:
                settle_interrupted_sync(Path(sync_journal), dead_pid=parent.pid)
            except Exception as error:  # noqa: BLE001 - the process ends either way: say why, never silently
                print(f"agrpo-rollout: could not settle the killed trainer's sync ({sync_journal}): {error!r}",
                      file=sys.stderr, flush=True)  # fmt: skip
        ch.stop.set()

    threading.Thread(target=watch_stop, daemon=True, name="agrpo-rollout-stop").start()
    threading.Thread(target=watch_parent, daemon=True, name="agrpo-rollout-parent").start()

    async def beat() -> None:
        while True:
            ch.heartbeat.value = time.time()
            await asyncio.sleep(_HEARTBEAT_PERIOD_S)

    heart = asyncio.ensure_future(beat())

    issued = IssuedSamples(loop.config.num_generations, ch.sample_allowance, ch.held)
    max_staleness = loop.config.max_staleness

    def on_group(outcome: Any) -> None:
        issued.outcome(outcome)
        ch.events.put(("group", dataclasses.replace(outcome, group=None)))

    def on_draw(row_index: int, epoch: int) -> None:
        issued.draw()
        ch.events.put(("draw", (epoch, row_index)))

    try:
        await loop.run(
            lambda sample: _put(ch.samples, ("sample", sample), ch.stop),
            policy_version=lambda: ch.version.value,
            on_group=on_group,
            on_draw=on_draw,
            may_dispatch=issued.may_dispatch,
            trainable=lambda version: ch.version.value - version <= max_staleness,  # else it is dropped
            on_server=lambda event: ch.events.put(("server", event)),
            metrics_sink=lambda metrics: _push_metrics(ch, metrics),
        )
    finally:
        heart.cancel()


def _push_metrics(ch: _Channels, metrics: dict[str, float]) -> None:
    """The loop's `metrics_sink`: metrics to the trainer, and a heartbeat (the loop pushed, so it runs)."""
    ch.heartbeat.value = time.time()
    ch.events.put(("metrics", metrics))


def warn_cpu_rewards(reward_funcs: list) -> None:
    """On a GPU machine, say once that reward models run on CPU in the rollout process (SPEC F-PROC)."""
    if reward_funcs:
        logger.warning(
            "reward functions, tools and environments run in the rollout process with CUDA_VISIBLE_DEVICES='': "
            "a reward model that asks for a GPU runs on CPU there. Serve such a model behind its own server and "
            "call it from a light reward function"
        )


def _flush(channel: Any, stop: Any) -> None:
    """Let `channel`'s feeder thread hand what is queued to the pipe (data in a pipe outlives its writer), but
    only while `stop` is unset. multiprocessing would otherwise join the feeder at exit without a limit, and a
    feeder blocked on a full pipe whose reader was SIGKILLed never returns: the worker would outlive its
    trainer (`watch_parent` sets `stop` once the trainer is gone)."""
    channel.close()
    feeder = threading.Thread(target=channel.join_thread, daemon=True, name="agrpo-rollout-flush")
    feeder.start()
    while feeder.is_alive() and not stop.is_set():
        feeder.join(0.1)
    channel.cancel_join_thread()


def _child_main(payload: bytes, ch: _Channels) -> None:
    """Entry point of the spawned process."""
    code, channels = 0, (ch.samples, ch.events)
    try:
        handoff = pickle.loads(payload)
        asyncio.run(_run_loop(handoff.build_loop(), ch, handoff.sync_journal))
        _put(ch.samples, ("end", None), ch.stop)
    except asyncio.CancelledError:  # stop() was called, or the trainer died: a clean end
        pass
    except BaseException:  # noqa: BLE001 - any failure becomes the trainer's error, with this traceback
        ch.events.put(("error", traceback.format_exc()))
        ch.samples.cancel_join_thread()  # queued samples are worthless now; exit without flushing them
        code, channels = 1, (ch.events,)
    for channel in channels:
        _flush(channel, ch.stop)
    if code:
        raise SystemExit(code)


class RolloutProcess:
    """The trainer's handle on the spawned rollout process. `start`, read with `next_sample_message` and
    `drain_events`, publish versions with `set_policy_version`, and always `stop`."""

    def __init__(self, handoff: RolloutHandoff, *, queue_maxsize: int, worker_timeout_s: float) -> None:
        self.handoff = handoff
        self.queue_maxsize = queue_maxsize
        self.worker_timeout_s = worker_timeout_s
        self.process: mp.process.BaseProcess | None = None
        self._channels: _Channels | None = None
        self._failure: str | None = None
        self._stopped_tracker = False

    def start(self) -> None:
        """Pickle-check the handoff, then spawn the worker (it connects to the server on its own)."""
        payload = pickle_handoff(self.handoff)
        ctx = mp.get_context("spawn")
        self._tracker_was_running = _tracker_running()
        self._channels = _Channels(
            samples=ctx.Queue(maxsize=self.queue_maxsize),
            events=ctx.Queue(),
            version=ctx.Value("i", 0, lock=False),
            sample_allowance=ctx.Value("q", 2**62, lock=False),
            held=ctx.Value("i", 0, lock=False),
            heartbeat=ctx.Value("d", 0.0, lock=False),
            stop=ctx.Event(),
        )
        self._started_at = time.time()
        self.process = ctx.Process(
            target=_child_main, args=(payload, self._channels), name="agrpo-rollout", daemon=True
        )
        with _child_environment():
            self.process.start()

    def set_sample_allowance(self, samples: int) -> None:
        """How many samples the producer may have issued in all, from the trainer's `DispatchHold`."""
        self._channels.sample_allowance.value = int(samples)

    def producer_held(self) -> bool:
        """Whether the producer waits for a larger sample allowance right now."""
        return bool(self._channels.held.value)

    def set_policy_version(self, version: int) -> None:
        """Groups dispatched from now on carry `version` (call only once the server serves it)."""
        self._channels.version.value = int(version)

    def next_sample_message(self, timeout_s: float) -> tuple[str, Any] | None:
        """("sample", RolloutSample) or ("end", None), or None after `timeout_s`; raises if the worker failed."""
        try:
            return self._channels.samples.get(timeout=timeout_s)
        except queue.Empty:
            pass  # checked outside the handler: an error raised in it would keep the queue alive in its context
        self.check()
        return None

    def queue_size(self) -> int:
        """Samples waiting in the rollout queue (`sample/rollout_queue_size`)."""
        return self._channels.samples.qsize()

    def drain_events(self) -> list[tuple[str, Any]]:
        """Every ("draw", (epoch, row)), ("group", GroupOutcome), ("server", ServerEvent) and ("metrics", dict)
        event so far; raises on a worker error."""
        events = []
        while True:
            try:
                kind, value = self._channels.events.get_nowait()
            except queue.Empty:
                return events
            if kind == "error":
                self._failure = value
                raise RolloutWorkerError(f"the rollout process raised:\n{value}")
            events.append((kind, value))

    def check(self) -> None:
        """Raise `RolloutWorkerError` if the worker raised, died, or its heartbeat is older than the timeout."""
        if self._failure is not None:
            raise RolloutWorkerError(f"the rollout process raised:\n{self._failure}")
        code = self.process.exitcode
        if code is not None and code != 0:
            self.drain_events()  # its traceback, if it managed to send one
            raise RolloutWorkerError(
                f"the rollout process exited with code {code}"
                + (f" (killed by signal {-code})" if code < 0 else "")
                + " without a traceback; check memory limits and the server, then resume from the last checkpoint"
            )
        beat = self._channels.heartbeat.value
        if beat == 0.0:  # still importing: the first beat comes once its event loop runs
            waited = time.time() - self._started_at
            if waited > max(self.worker_timeout_s, _STARTUP_TIMEOUT_S):
                raise RolloutWorkerError(
                    f"the rollout process did not start its event loop within {waited:.0f} s; it is stuck importing "
                    "or unpickling what it was given (a heavy reward module?)"
                )
            return
        age = time.time() - beat
        if age > self.worker_timeout_s:
            raise RolloutWorkerError(
                f"no heartbeat from the rollout process for {age:.0f} s (rollout_worker_timeout="
                f"{self.worker_timeout_s:g}); its event loop is stuck (a blocking call in a reward, tool or "
                "loop hook?) Raise rollout_worker_timeout if that work is legitimately slow"
            )

    def stop(self, timeout_s: float = 15.0) -> None:
        """End the worker (politely, then terminate, then kill) and release every channel."""
        process, ch = self.process, self._channels
        if process is None or ch is None:
            return
        ch.stop.set()
        process.join(timeout_s)
        for end in (process.terminate, process.kill):
            if process.is_alive():
                end()
                process.join(5.0)
        for channel in (ch.samples, ch.events):
            channel.cancel_join_thread()
            channel.close()
        process.close()
        self.process, self._channels = None, None
        del process, ch, channel
        gc.collect()  # the semaphores' finalizers unregister them from the resource tracker
        if not self._tracker_was_running:
            _stop_tracker()


def _tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_fd", None) is not None


def _stop_tracker() -> None:
    """Stop multiprocessing's resource tracker, a child process that `start` made exist."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if hasattr(tracker, "_stop"):
        tracker._stop()
