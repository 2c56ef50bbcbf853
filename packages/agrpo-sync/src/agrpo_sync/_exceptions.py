"""The errors agrpo-sync raises on purpose.

Owns the hierarchy. Errors about the user's setup (server flags, config values) subclass `ValueError`
and name the fix; errors about something that went wrong while talking to the server subclass
`WeightSyncError` and say what happened and in which state the server was left.

    ValueError
    └── SyncSetupError           the config or the server's flags cannot do the requested sync
    RuntimeError
    └── WeightSyncError          a weight sync could not be completed
        ├── ServerRequestError   an HTTP call to the server failed (endpoint, status, body)
        │   └── ServerUnreachableError  not even a fresh connection reaches it: its process is gone
        ├── TransportError       the NCCL (or test) transport failed: library, rendezvous, collective
        └── TransferFailedError  a transfer failed; says what the server serves and whether it was left paused
            └── ManifestMismatchError  refused before pausing: missing, extra or misshapen tensors
"""

from __future__ import annotations


class SyncSetupError(ValueError):
    """The server or the config cannot do the requested sync; the message names the flag or field to change."""


class WeightSyncError(RuntimeError):
    """A weight sync could not be completed."""


class ServerRequestError(WeightSyncError):
    """An HTTP call to the vLLM server failed or answered an error status."""

    def __init__(self, endpoint: str, status: int | None, detail: str) -> None:
        self.endpoint = endpoint
        self.status = status
        self.detail = detail
        seen = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{endpoint}: {seen}: {detail}")


class ServerUnreachableError(ServerRequestError):
    """A call failed at transport level and a fresh connection to the server fails too: its process is gone
    (or not up yet). With several servers, a sync leaves such a server out and goes on with the others."""


class TransportError(WeightSyncError):
    """The byte transport (NCCL through ctypes, or a test transport) failed."""


class TransferFailedError(WeightSyncError):
    """A transfer failed. `server_state` says what the server serves now and, when `left_paused`, how to
    resume it (generation stays paused rather than serve weights that mix two versions)."""

    def __init__(self, message: str, *, server_state: str, left_paused: bool = False) -> None:
        self.server_state = server_state
        self.left_paused = left_paused
        super().__init__(f"{message}; {server_state}")


class ManifestMismatchError(TransferFailedError):
    """The tensors a sync would send differ from what the server holds (names, shapes or dtypes). Raised
    before generation pauses: nothing reached the server. `problems` lists them, tensors named."""

    def __init__(self, message: str, *, problems: list[str], server_state: str) -> None:
        self.problems = problems
        super().__init__(message, server_state=server_state)
