"""Training without a generation server, on samples recorded or made beforehand: `ReplaySource`, `ReplayTrainer`.

For tests and for measuring the trainer's own optimizer step where no vLLM server runs (a GPU machine given
rollouts recorded from a CPU-server run). `ReplaySource` has the methods of the spawned rollout process: it
hands out the samples in order, then one kept outcome per group, then the end. `ReplayTrainer` is
`AsyncGRPOTrainer` reading one and pushing no weights; everything else (packing, the step, compile,
checkpointing, metrics) is the trainer's own. Never a stand-in where a server is the point of a test.
"""

from __future__ import annotations

from typing import Any

from agrpo_rollout import GroupOutcome, RolloutSample

from ._trainer import AsyncGRPOTrainer


class ReplaySource:
    """The samples, then one kept outcome per group, then the end; same methods as `RolloutProcess`."""

    def __init__(self, samples: list[RolloutSample]) -> None:
        self.samples = samples
        self.version = 0
        self._messages: list = []
        self._events: list = []

    def start(self) -> None:
        self._messages = [("sample", s) for s in self.samples] + [("end", None)]
        counts: dict[int, int] = {}
        for sample in self.samples:
            counts[sample.group_id] = counts.get(sample.group_id, 0) + 1
        self._events = [("draw", (0, group_id)) for group_id in counts] + [
            ("group", GroupOutcome(group_id, 0, group_id, True, "", count, None))
            for group_id, count in counts.items()
        ]

    def set_policy_version(self, version: int) -> None:
        self.version = version

    def next_sample_message(self, timeout_s: float) -> tuple[str, Any] | None:
        return self._messages.pop(0) if self._messages else None

    def drain_events(self) -> list:
        events, self._events = self._events, []
        return events

    def queue_size(self) -> int:
        return len(self._messages)

    def check(self) -> None:
        pass

    def stop(self) -> None:
        self._messages = []


class ReplayTrainer(AsyncGRPOTrainer):
    """Trains on `replay_samples` (set before `train()`); no server, no weight sync."""

    replay_samples: list[RolloutSample] = []

    def _make_sample_source(self, num_processes: int) -> ReplaySource:
        return ReplaySource(list(self.replay_samples))

    def _start_policy_sync(self):
        return None

    def _max_model_len(self):
        return None
