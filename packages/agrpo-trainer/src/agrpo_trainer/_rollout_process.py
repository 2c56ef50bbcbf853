"""`RolloutProcess`: the rollout loop in a spawned CPU process, and the trainer's end of it (SPEC F-PROC).

Owns the process boundary: what crosses it (`RolloutHandoff`, pickled once at start and checked object by
object, so a lambda fails with its name and the fix), the channels (a bounded sample queue, an unbounded
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
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from agrpo_rollout import RolloutConfig

from ._exceptions import RolloutWorkerError

logger = logging.getLogger("agrpo_trainer")

# torchrun/accelerate variables that would make the child think it is a distributed rank.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")  # fmt: skip
_HEARTBEAT_PERIOD_S = 1.0
_STARTUP_TIMEOUT_S = 300.0
"""Seconds the child may take to import and unpickle before its first heartbeat."""


class LoopSettings:
    """What the loop reads as `self.config`: the resolved `RolloutConfig` fields first, then the trainer
    config's (so fields of an `AsyncGRPOConfig` subclass reach a custom loop, as in the reference)."""

    def __init__(self, rollout: RolloutConfig, trainer: Any) -> None:
        self.rollout = rollout
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        if name in ("rollout", "trainer"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        try:
            return getattr(self.rollout, name)
        except AttributeError:
            return getattr(self.trainer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"rollout": self.rollout, "trainer": self.trainer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.rollout, self.trainer = state["rollout"], state["trainer"]


@dataclass(kw_only=True)
class RolloutHandoff:
    """Everything the spawned process gets; every part must pickle (module-level functions and classes)."""

    loop_cls: type
    settings: LoopSettings
    tokenizer: Any
    dataset: Any
    reward_funcs: list[Callable]
    tools: list[Callable]
    environment_factory: Any
    start_index: int = 0
    max_epochs: int | None = None
    skip_prompts: frozenset[tuple[int, int]] = frozenset()
    """Prompts a resumed run already trained, in the loop's own epochs."""

    def build_loop(self) -> Any:
        return self.loop_cls(
            self.settings,
            tokenizer=self.tokenizer,
            dataset=self.dataset,
            reward_funcs=self.reward_funcs,
            tools=self.tools,
            environment_factory=self.environment_factory,
            start_index=self.start_index,
            max_epochs=self.max_epochs,
            skip_prompts=self.skip_prompts,
        )


def _named_parts(handoff: RolloutHandoff) -> Iterator[tuple[str, Any, str]]:
    """(name, object, fix) of every user-supplied part, checked one by one for a precise message."""
    module_level = (
        "define it at module level (a function, functools.partial of one, or a callable class instance)"
    )
    for i, func in enumerate(handoff.reward_funcs):
        yield f"reward_funcs[{i}] {getattr(func, '__qualname__', func)!r}", func, module_level
    for i, tool in enumerate(handoff.tools):
        fix = "tools are registered by __name__: make it a module-level function"
        yield f"tools[{i}] {getattr(tool, '__qualname__', tool)!r}", tool, fix
    factory = handoff.environment_factory
    factories = (
        factory.items() if isinstance(factory, dict) else ([("", factory)] if factory is not None else [])
    )
    for key, value in factories:
        where = f"environment_factory[{key!r}]" if key else "environment_factory"
        yield f"{where} {getattr(value, '__qualname__', value)!r}", value, module_level
    yield (
        f"loop_cls {handoff.loop_cls.__qualname__!r}",
        handoff.loop_cls,
        "define the loop subclass at module level",
    )
    yield "the trainer config (args)", handoff.settings.trainer, "keep config fields plain values"
    yield "train_dataset", handoff.dataset, "pass a datasets.Dataset/IterableDataset or a list of dicts"
    yield "processing_class", handoff.tokenizer, "pass a tokenizer loaded with from_pretrained"


def pickle_handoff(handoff: RolloutHandoff) -> bytes:
    """The handoff as bytes; a part that cannot cross the process boundary raises TypeError naming it."""
    for name, obj, fix in _named_parts(handoff):
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise TypeError(
                f"{name} cannot be sent to the rollout process, which is spawned and receives everything pickled "
                f"({type(error).__name__}: {error}); a lambda or a closure cannot be pickled: {fix}"
            ) from error
    return pickle.dumps(handoff)


@dataclass(frozen=True, kw_only=True)
class _Channels:
    samples: Any
    events: Any
    version: Any
    heartbeat: Any
    stop: Any


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


async def _run_loop(loop: Any, ch: _Channels) -> None:
    main = asyncio.current_task()
    event_loop = asyncio.get_running_loop()

    def watch_stop() -> None:
        # Polled, never `wait()`ed: a process that dies inside Event.wait leaves the event's condition
        # expecting its acknowledgement, and the trainer's `set()` would then block forever.
        while not ch.stop.is_set():
            time.sleep(0.1)
        event_loop.call_soon_threadsafe(main.cancel)

    def watch_parent() -> None:  # a trainer killed with SIGKILL never calls stop(): do not outlive it
        mp.connection.wait([mp.parent_process().sentinel])
        ch.stop.set()

    threading.Thread(target=watch_stop, daemon=True, name="agrpo-rollout-stop").start()
    threading.Thread(target=watch_parent, daemon=True, name="agrpo-rollout-parent").start()

    async def beat() -> None:
        while True:
            ch.heartbeat.value = time.time()
            await asyncio.sleep(_HEARTBEAT_PERIOD_S)

    heart = asyncio.ensure_future(beat())

    def on_group(outcome: Any) -> None:
        ch.events.put(("group", dataclasses.replace(outcome, group=None)))

    try:
        await loop.run(
            lambda sample: _put(ch.samples, ("sample", sample), ch.stop),
            policy_version=lambda: ch.version.value,
            on_group=on_group,
            on_draw=lambda row_index, epoch: ch.events.put(("draw", (epoch, row_index))),
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


def _child_main(payload: bytes, ch: _Channels) -> None:
    """Entry point of the spawned process."""
    try:
        loop = pickle.loads(payload).build_loop()
        asyncio.run(_run_loop(loop, ch))
        _put(ch.samples, ("end", None), ch.stop)
    except asyncio.CancelledError:  # stop() was called: a clean end
        pass
    except BaseException:  # noqa: BLE001 - any failure becomes the trainer's error, with this traceback
        ch.events.put(("error", traceback.format_exc()))
        ch.samples.cancel_join_thread()  # queued samples are worthless now; exit without flushing them
        ch.events.close()
        ch.events.join_thread()
        raise SystemExit(1) from None
    if ch.stop.is_set():  # the trainer stopped reading: do not wait at exit to flush queued samples
        ch.samples.cancel_join_thread()


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
            heartbeat=ctx.Value("d", 0.0, lock=False),
            stop=ctx.Event(),
        )
        self._started_at = time.time()
        self.process = ctx.Process(
            target=_child_main, args=(payload, self._channels), name="agrpo-rollout", daemon=True
        )
        with _child_environment():
            self.process.start()

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
