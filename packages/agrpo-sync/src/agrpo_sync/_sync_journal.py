"""`SyncJournal`: what a sync under way has done to the servers, kept on disk for whoever outlives a killed trainer.

A trainer killed with SIGKILL between `POST /pause` and `POST /resume` leaves its servers paused, and
everyone else using them (an evaluation, a second trainer, its own rollout process) waits with no word. The
sending rank therefore records each phase before it acts, in `<output_dir>/.vllm_sync.json` (written by
replacing the file, so a reader never sees half of it):

- `pausing` (before the first `/pause`): nothing is sent yet, so every server holds one whole version, the
  previous one. Safe to resume.
- `sending` (before the first byte): a disk reload reads a version directory written completely before the
  pause, so reloading that directory again puts the server on one whole version, which is then labelled and
  resumed. An NCCL transfer cut short may leave weights of two versions: that server stays paused, and
  whoever settles the journal says so on stderr with the ways out.
- `sent` (every server took the version and was labelled): safe to resume.

The file is removed once the servers are resumed. `settle_interrupted_sync` is called by the rollout process
when it sees its trainer die, and by `WeightSync.start` on the next start-up in the same output directory
(the rollout process may have died with its trainer). Does not know ranks or models.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ._exceptions import ServerRequestError
from ._server_control import ServerControl

logger = logging.getLogger("agrpo_sync")

JOURNAL_NAME = ".vllm_sync.json"
PHASES = ("pausing", "sending", "sent")


@dataclass(kw_only=True)
class SyncEntry:
    """One sync's progress as the trainer last recorded it."""

    phase: str
    version: int
    backend: str
    servers: list[str]
    weights_path: str | None = None
    """The disk backend's complete version directory (reloading it again yields exactly `version`)."""
    pid: int = field(default_factory=os.getpid)
    """The trainer process that wrote it: a live one is never second-guessed."""


class SyncJournal:
    """Records a sync's phases in one small file; `clear` once the servers are resumed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def record(self, entry: SyncEntry) -> None:
        assert entry.phase in PHASES, entry.phase
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        with open(partial, "w") as f:
            json.dump(asdict(entry), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)

    def note(
        self, phase: str, version: int, backend: str, servers: list[str], weights_path: str | None
    ) -> None:
        self.record(
            SyncEntry(
                phase=phase, version=version, backend=backend, servers=servers, weights_path=weights_path
            )
        )

    def read(self) -> SyncEntry | None:
        try:
            return SyncEntry(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as error:
            logger.warning("ignoring the unreadable sync journal %s: %s", self.path, error)
            return None

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def settle_interrupted_sync(
    path: Path, *, timeout_s: float = 300.0, dead_pid: int | None = None
) -> list[str]:
    """Resume the servers a killed trainer's sync left paused wherever their weights are one whole version, and
    say on stderr which stay paused and why. Returns what it did, one line per server (empty: nothing to do).
    `dead_pid`: a process the caller saw die (its parent's sentinel closed); a journal it wrote is settled at
    once, since the kernel closes a killed process's files before `/proc` shows it as a zombie."""
    journal = SyncJournal(path)
    entry = journal.read()
    if entry is None or (entry.pid not in (os.getpid(), dead_pid) and _is_alive(entry.pid)):
        return []
    lines, held = [], False
    for url in entry.servers:
        control = ServerControl(url, timeout_s=30.0, transfer_timeout_s=timeout_s)
        try:
            line = _settle(control, entry)
        except ServerRequestError as error:
            line, held = (
                f"{url}: could not settle the interrupted sync of version {entry.version}: {error}",
                True,
            )
        finally:
            control.close()
        held |= "left paused" in line
        lines.append(line)
    for line in lines:
        print(f"agrpo-sync: {line}", file=sys.stderr, flush=True)
    if not held:
        journal.clear()
    return lines


def _settle(control: ServerControl, entry: SyncEntry) -> str:
    url, version = control.base_url, entry.version
    if not control.answers():
        return f"{url}: does not answer; nothing to resume (a restarted server starts unpaused)"
    if entry.phase == "pausing":
        control.resume()
        return f"{url}: resumed; the trainer was killed before sending version {version}, so it serves the version before"
    if (
        entry.phase == "sending"
        and entry.backend == "disk"
        and entry.weights_path
        and Path(entry.weights_path).is_dir()
    ):
        control.reload_weights(entry.weights_path)
        control.set_weight_version(str(version))
        control.resume()
        return f"{url}: reloaded version {version} from {entry.weights_path} (the killed trainer's reload) and resumed"
    if entry.phase == "sending":
        return (
            f"{url}: left paused: the trainer was killed while sending version {version} ({entry.backend}), so its "
            "weights may mix two versions. Restart the trainer with resume_from_checkpoint=True (its first sync "
            f"sends every weight and resumes generation), or restart the server; POST {url}/resume serves the "
            "weights as they are, mixed ones included"
        )
    control.resume()
    return f"{url}: resumed; the trainer was killed after every server took version {version}"


def _is_alive(pid: int) -> bool:
    """A pid that exists and is not a zombie (a killed trainer its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
