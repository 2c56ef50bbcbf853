"""`ServerRoster`: which servers a weight sync goes to, and which version each one was last given.

Owns, on the sending rank, the label every server was last given (the trainer labels each server with
the policy version after each push; `/weight_info` reads it back), the check before each sync, and the
servers left out of one. Before a sync every server's label is read (one small request each): the label
this trainer set means the server still serves that version; any other (a fresh process says `default`)
means it restarted, or its weights were changed behind the trainer's back, and it is rejoined
(`SyncBackend.rejoin`: e.g. a new NCCL rendezvous, the adapter window registered again), so this sync
sends it every weight. A server that accepts no connection (`ServerUnreachableError`) is left out of the
sync, and so is one that stops answering during it; a server left out is rejoined as soon as a later sync
finds it answering. A server that cannot report a label (no `/weight_info`: adapter sync without dev
mode) is rejoined before every sync, which for adapters costs one `GET /v1/models`. A version is served
once every server of its sync serves it (`served`; `members` are those servers). Also owns `each_server`,
which makes one call per server in parallel (threads: the calls are blocking HTTP). Does not know the
backends' protocols, pausing or ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from ._exceptions import ServerRequestError, ServerUnreachableError
from ._server_control import ServerControl

logger = logging.getLogger("agrpo_sync")


def each_server(call: Callable[[int], object], indices: Iterable[int]) -> set[int]:
    """Run `call(i)` for every server index at once and wait for all; return the servers that turned out
    unreachable, and raise the first other error (after every call ended, so none is left running)."""
    indices = list(indices)
    if len(indices) <= 1:
        outcomes = [_outcome(call, i) for i in indices]
    else:
        with ThreadPoolExecutor(len(indices), thread_name_prefix="agrpo-sync-server") as pool:
            outcomes = list(pool.map(lambda i: _outcome(call, i), indices))
    lost = {
        i for i, error in zip(indices, outcomes, strict=True) if isinstance(error, ServerUnreachableError)
    }
    failed = [
        error for error in outcomes if error is not None and not isinstance(error, ServerUnreachableError)
    ]
    if failed:
        raise failed[0]
    return lost


def _outcome(call: Callable[[int], object], index: int) -> BaseException | None:
    try:
        call(index)
    except Exception as error:  # noqa: BLE001 - handed back to each_server, which raises or counts it
        return error
    return None


class ServerRoster:
    """The servers of a weight sync (sending rank): `roll` before each sync, `served` after it."""

    def __init__(self, controls: list[ServerControl]) -> None:
        self.controls = controls
        self.labels: list[str | None] = [None] * len(controls)
        """The label this trainer last gave each server (None: not yet)."""
        self.members: set[int] = set(range(len(controls)))
        """The servers that serve the last version pushed (all of them before the first sync)."""
        self.current: set[int] = set()
        """The servers of the sync under way that still answer."""

    def url(self, index: int) -> str:
        return self.controls[index].base_url

    @property
    def targets(self) -> list[int]:
        """The servers of the sync under way that still answer, in order."""
        return sorted(self.current)

    def roll(self, rejoin: Callable[[int], None]) -> list[int]:
        """The servers this sync goes to; those that restarted (or were left out) are rejoined first."""
        self.current, targets = set(), []
        for index, control in enumerate(self.controls):
            expected = self.labels[index]
            if expected is None and index in self.members:  # never synced nor lost: nothing to compare yet
                targets.append(index)
                continue
            try:
                label = control.weight_version()
            except ServerUnreachableError as error:
                self.lose(index, error)
                continue
            except ServerRequestError:
                label = None  # no /weight_info: cannot tell, so rejoin it every time (cheap where it happens)
            if label is not None and expected is not None and label != expected:
                logger.warning(
                    "vLLM server %s answers weight label %r where this trainer set %r: it restarted (or its weights "
                    "were changed); rejoining it, and this sync sends it every weight",
                    self.url(index), label, expected,
                )  # fmt: skip
            elif index not in self.members:  # lost earlier; its label unreadable or unchanged
                logger.warning(
                    "vLLM server %s answers again; rejoining it, and this sync sends it every weight",
                    self.url(index),
                )
            if label is None or label != expected or index not in self.members:
                try:
                    rejoin(index)
                except ServerUnreachableError as error:
                    self.lose(index, error)
                    continue
            targets.append(index)
        self.current = set(targets)
        return targets

    def lose(self, index: int, error: object) -> None:
        """Leave a server out of the current sync (it stopped answering); it is rejoined once it answers."""
        self.current.discard(index)
        if index in self.members or self.labels[index] is not None:
            logger.warning(
                "vLLM server %s does not answer (%s); the weight sync goes on without it, and it is rejoined "
                "(sent every weight) once it answers again",
                self.url(index), error,
            )  # fmt: skip
        self.members.discard(index)

    def pause(self, mode: str, clear_cache: bool) -> tuple[list[int], str | None]:
        """Pause every target: (paused, None), or ([], the refusal) when one refused (those already paused
        are resumed: nothing was sent). A target that does not answer is left out."""
        paused = []
        for index in self.targets:
            try:
                self.controls[index].pause(mode, clear_cache)
            except ServerUnreachableError as error:
                self.lose(index, error)
                continue
            except ServerRequestError as error:
                self.resume(paused)
                return [], str(error)
            paused.append(index)
        return paused, None

    def resume(self, paused: list[int]) -> None:
        """Resume the paused servers that are still targets; one that stopped answering is left out."""
        for index in paused:
            if index not in self.current:
                continue
            try:
                self.controls[index].resume()
            except ServerUnreachableError as error:
                self.lose(index, error)

    def needs_resync(self, index: int) -> bool:
        """Whether a server that answers does not hold the last version pushed (rank 0; False while it does
        not answer: there is nothing to send it yet)."""
        try:
            label = self.controls[index].weight_version()
        except ServerUnreachableError:
            return False
        except ServerRequestError:
            return True
        return index not in self.members or label != self.labels[index]

    def served(self, version: int) -> None:
        """Every server of the sync that still answers now serves `version` (labelled so): the members."""
        self.members = set(self.current)
        for index in self.members:
            self.labels[index] = str(version)
