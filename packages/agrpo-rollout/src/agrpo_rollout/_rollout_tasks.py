"""`RolloutTasks`: every task a running loop started, and the first failure that must end them all.

Owns spawning (a task is cancelled with the loop when the loop stops or fails), cancelling them all,
and `failed`: a future the loop watches, set by the first fatal error of any rollout or group. A
rollout records its error before it gives its concurrency slot back, and the dispatcher checks
`raise_failure` after every slot it takes, so no new rollout goes to a failing server once one has
failed: a run against a dead server ends one retry budget after the server died, not after every
in-flight group has failed too. Does not know what a rollout does or which errors are fatal (the
loop decides: a 404 for a retired LoRA adapter is not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class RolloutTasks:
    """The tasks of one `run`; create it inside the running event loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        """Completes with the first fatal error; the loop raises it (the original error, unchanged)."""

    def spawn(self, coroutine: Awaitable, *, fatal: bool = False) -> asyncio.Task:
        """A task cancelled with the loop; with `fatal`, its error also ends the run at once."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        if fatal:
            task.add_done_callback(self._fail_with)
        return task

    def fail(self, error: BaseException) -> None:
        """Record a fatal error (the first one wins)."""
        if not self.failed.done():
            self.failed.set_exception(error)

    def raise_failure(self) -> None:
        """Raise the recorded fatal error, if any."""
        if self.failed.done():
            self.failed.result()

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here; whoever awaits the task still gets it raised

    def _fail_with(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())

    async def cancel_all(self) -> None:
        """Cancel every task still running and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.failed.done():
            self.failed.exception()  # retrieved: the run raised it, or another error ended the run first
        else:
            self.failed.cancel()
