"""`ServerEvent`: a change in the state of one generation server, as the rollout loop reports it.

Owns the record and the meaning of each state. It is small and picklable: the trainer's rollout process
forwards every event on its event channel, logs it, and re-syncs a server that reports `resync`. Does not
know how a state is decided (`_pooled_server.py`) nor what the listener does with it.

    serving    takes groups: it answers, and (under a trainer) its weights serve the published policy version
    checking   a request or a `/metrics` poll failed at transport level; one identity check decides
    down       it refused connections (or gave no answer for `vllm_server_timeout`): its process is gone, and
               every rollout in flight there is abandoned (its group is dispatched again)
    resync     it answers, but its weights are not the published version (a new process starts from its own
               checkpoint; or it missed a push): it takes no group until the trainer has re-synced it
    lost       down for longer than `vllm_server_timeout`; with another server serving, the loop goes on
               without it (and takes it back if it ever answers); with none, the run fails
"""

from __future__ import annotations

from dataclasses import dataclass

SERVING = "serving"
CHECKING = "checking"
DOWN = "down"
RESYNC = "resync"
LOST = "lost"


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """One state change of one server (see the module docstring for the states)."""

    index: int
    """The server's position in `vllm_server_base_url`."""
    url: str
    state: str
    detail: str
    """Why, in words (the error seen, the label read), for the log."""
    incarnation: int
    """Processes of this server known to be gone so far (0 while its first process serves)."""
