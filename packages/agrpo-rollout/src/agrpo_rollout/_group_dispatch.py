"""`GroupDispatch`: the producer's front half: prompts drawn, their groups started on a server, collected.

Owns drawing prompts (a `PromptSource` through the loop's `filter_prompt`; rejected ones are reported
`filtered`; none is drawn while the score queue is full, so a blocked sink bounds what is generated
ahead), the prompts handed back by groups whose server lost its process mid-generation (dispatched
again, first in line: nothing a dead or not yet re-synced process generated is emitted, no prompt is
lost, and each still gets exactly one `GroupOutcome`; `redispatched` counts them), starting a group's
rollouts on one server of the pool, bound to the policy version and the server process they start
under, and collecting each finished group onto the score queue. A group whose LoRA adapter version
was unloaded mid-generation is reported `stale` (after waiting up to `_RETIRED_WAIT_S` for the newer
published version that explains the 404). Does not know how a rollout runs (the loop's `_run_rollout`),
scoring (`_group_scoring.py`) or server health (`_pooled_server.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._client import POLICY_VERSION
from ._config import RolloutConfig
from ._exceptions import RequestRejectedError, ServerLostError
from ._group import RolloutGroup
from ._group_outcome import GroupOutcome
from ._pooled_server import BOUND
from ._prompt_source import PromptDraw
from ._request_seed import REQUEST_SEEDS, RequestSeeds
from ._rollout_metrics import RolloutMetrics
from ._rollout_tasks import RolloutTasks
from ._server_pool import ServerPool

_QUEUE_POLL_S = 0.02
_TRAINABLE_CHECK_S = 0.25
_RETIRED_WAIT_S = 30.0
"""How long a 404 for a group's adapter waits for a newer policy version before it counts as an error."""


def maybe_retired(config: RolloutConfig, error: BaseException) -> bool:
    """A 404 for a `{version}` adapter: maybe retired (`GroupDispatch` decides), not yet fatal."""
    return (
        isinstance(error, RequestRejectedError)
        and error.status_code == 404
        and "{version}" in (config.model_name or "")
    )


@dataclass(kw_only=True)
class GroupDispatch:
    """Dispatches every group of one `run`; `run()` returns once every group was collected."""

    config: RolloutConfig
    draws: Iterator[PromptDraw]
    pool: ServerPool
    tasks: RolloutTasks
    metrics: RolloutMetrics
    run_rollout: Callable[[Any, int], Awaitable[Any]]
    """`(row, group_id)` -> a finished rollout (the loop's `_run_rollout`)."""
    queue: asyncio.Queue
    policy_version: Callable[[], int]
    on_group: Callable[[GroupOutcome], None] | None = None
    on_draw: Callable[[int, int], None] | None = None
    max_groups: int | None = None
    may_dispatch: Callable[[], bool] | None = None
    """The caller's hold on new groups (a trainer: none that could not be trained within its staleness)."""
    trainable: Callable[[int], bool] | None = None
    """Whether a group started at this policy version can still be trained; one that cannot is cancelled."""
    redispatched: int = 0
    """Groups abandoned because their server lost its process; their prompts were dispatched again."""

    def __post_init__(self) -> None:
        self._again: deque[PromptDraw] = deque()
        self._collectors: set[asyncio.Task] = set()
        self._fresh = 0

    async def run(self) -> None:
        group_id = 0
        while True:
            await self._score_queue_room()
            await self._caller_room()
            if (draw := await self._next_draw()) is None:
                break
            columns = {k: [v] * self.config.num_generations for k, v in draw.row.items() if k != "prompt"}
            group = RolloutGroup(
                [], columns, [], [], [], [], [], 0, group_id, draw.row_index, [], [], epoch=draw.epoch
            )
            tasks = await self._start(draw, group)
            self._collectors.add(self.tasks.spawn(self._collect(tasks, group, draw), fatal=True))
            self._collectors = {c for c in self._collectors if not c.done()}
            group_id += 1
        await self.queue.put(None)

    async def _score_queue_room(self) -> None:
        """Backpressure: no new group while the score queue is full (the sink, hence scoring, is blocked). A
        rollout gives its slot back when it ends, so slots alone would let finished groups pile up without
        bound in front of a full queue."""
        while self.queue.full():
            await asyncio.sleep(_QUEUE_POLL_S)

    async def _caller_room(self) -> None:
        """No new group while the caller's `may_dispatch` says no (a prompt handed back waits too: it is new
        work for the server all the same)."""
        while self.may_dispatch is not None and not self.may_dispatch():
            await asyncio.sleep(_QUEUE_POLL_S)

    async def _next_draw(self) -> PromptDraw | None:
        """A prompt handed back by a lost group, else the next accepted fresh draw (up to `max_groups`),
        else, once every group in flight is collected (one may hand a prompt back), None."""
        while True:
            if self._again:
                return self._again.popleft()
            more = self.max_groups is None or self._fresh < self.max_groups
            draw = next(self.draws, None) if more else None
            if draw is not None and draw.accepted:
                self._fresh += 1
                if self.on_draw is not None:  # before any of its samples exists: the prompt is in flight
                    self.on_draw(draw.row_index, draw.epoch)
                return draw
            if draw is not None:
                if self.on_group is not None:
                    self.on_group(GroupOutcome(draw.row_index, draw.epoch, -1, False, "filtered", 0, None))
                continue
            pending = {c for c in self._collectors if not c.done()}
            if not pending:
                return None
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def _start(self, draw: PromptDraw, group: RolloutGroup) -> list[asyncio.Task]:
        """Start the group's rollouts, all on the server its first slot picked; their tasks."""
        tasks, server, bound = [], None, None
        try:
            for generation in range(self.config.num_generations):
                if server is None:
                    server = await self.pool.acquire()
                else:
                    await self.pool.acquire_on(server)
                self.tasks.raise_failure()  # a rollout failed: send nothing more to the server
                if not tasks:  # the weights it runs on: a re-synced server's label may be a version ahead
                    group.model_version = max(int(self.policy_version()), server.served_version or 0)
                    POLICY_VERSION.set(group.model_version)  # copied into the group's tasks: their requests
                    bound = server.bind()  # and the server process they start on: a restart is seen
                if self.config.seed is not None:
                    REQUEST_SEEDS.set(RequestSeeds(self.config.seed, draw.epoch, draw.row_index, generation))
                tasks.append(self.tasks.spawn(self.run_rollout(draw.row, group.group_id)))
        finally:
            if bound is not None:
                BOUND.reset(bound)
        return tasks

    async def _collect(self, tasks: list[asyncio.Task], group: RolloutGroup, draw: PromptDraw) -> None:
        try:
            finished = await self._finished_while_trainable(tasks, group)
        except _Untrainable:  # its requests are closed, so the server aborts them: no more work on it
            self.metrics.groups_cancelled += 1
            if self.on_group is not None:
                self.on_group(
                    GroupOutcome(group.row_index, group.epoch, group.group_id, False, "stale", 0, group)
                )
            return
        except ServerLostError:  # its server's process is gone: the prompt goes again, first in line
            await _cancelled(tasks)
            self.redispatched += 1
            self._again.append(draw)
            return
        except RequestRejectedError as error:
            if not await self._adapter_retired(error, group):
                raise
            await _cancelled(tasks)
            self.metrics.groups_stale += 1
            if self.on_group is not None:
                self.on_group(
                    GroupOutcome(group.row_index, group.epoch, group.group_id, False, "stale", 0, group)
                )
            return
        group.collect(finished)
        blocked = time.monotonic()
        await self.queue.put(group)
        self.metrics.score_block_s += time.monotonic() - blocked

    async def _finished_while_trainable(self, tasks: list[asyncio.Task], group: RolloutGroup) -> list[Any]:
        """The group's finished rollouts; raises `_Untrainable` (its rollouts cancelled) as soon as the caller's
        `trainable` says its policy version is too old to train (checked every `_TRAINABLE_CHECK_S`)."""
        gathered = asyncio.gather(*tasks)
        gathered.add_done_callback(_retrieved)  # if this collector is cancelled first, nobody else reads it
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=_TRAINABLE_CHECK_S)
            if done:
                return gathered.result()
            if self.trainable is not None and not self.trainable(group.model_version):
                await _cancelled(tasks)
                raise _Untrainable

    async def _adapter_retired(self, error: RequestRejectedError, group: RolloutGroup) -> bool:
        """A 404 for the group's `{version}` adapter once a newer version is published: the trainer unloaded
        it (it left the LoRA window, so its samples would be dropped as stale anyway). The trainer publishes
        the new version just after the server loads it, so wait for that a little."""
        if not maybe_retired(self.config, error):
            return False
        deadline = time.monotonic() + _RETIRED_WAIT_S
        while self.policy_version() <= group.model_version:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def _retrieved(gathered: asyncio.Future) -> None:
    """Mark a gather's outcome as read (its errors reach the run through the rollout tasks themselves)."""
    if not gathered.cancelled():
        gathered.exception()


class _Untrainable(Exception):
    """A group's policy version fell out of what the caller can train: its rollouts were cancelled."""


async def _cancelled(tasks: list[asyncio.Task]) -> None:
    """Cancel the rest of a group's rollouts and wait for them (each gives its slot back)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
