"""`BackgroundCall`: one blocking call run on a daemon thread, so the caller can do the other half of a rendezvous.

Owns the thread, the result or the exception, and a bounded wait. The server's `/init_weight_transfer_engine`
and `/update_weights` only return once the trainer has done its NCCL half, so they must run beside it.
Does not know what the call is. The thread is a daemon and is never joined without a timeout: if the
trainer's half failed, the server's call may never return, and joining it would turn an error into a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundCall:
    """Runs `fn(*args)` on a daemon thread; `wait` returns its result or re-raises its exception."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "agrpo-sync-call") -> None:
        self._fn = fn
        self._args = args
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> BackgroundCall:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._result = self._fn(*self._args)
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
            self._error = error
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the call to finish, without raising; True if it finished."""
        return self._done.wait(timeout_s)

    def failed(self) -> bool:
        """True once the call has finished with an exception."""
        return self._done.is_set() and self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The exception the call finished with (None while running or after a normal return)."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout_s: float) -> Any:
        """The call's result; re-raises its exception; `TimeoutError` if it is still running after `timeout_s`."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"{self._thread.name} still running after {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result
