"""`DroppedGroupGuard`: stops a run whose groups are all dropped before training (`NothingTrainedError`).

GRPO learns from the spread of rewards within a group, so a group whose scored rewards are all equal
(`zero_std`) or that has fewer than two scorable rollouts (`unscorable`) is dropped before the queue (SPEC:
Rewards). When every group is dropped, no sample reaches the trainer while the server keeps generating: the
prompts are solved (every rollout right), out of reach (every rollout wrong), or the reward cannot tell
rollouts apart (a constant, None everywhere). Without this guard such a run waits for samples forever.
Counts group outcomes on rank 0; does not know where they come from.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ._exceptions import NothingTrainedError

DROPPED_REASONS = ("zero_std", "unscorable")
"""The outcomes that say a group taught nothing (a `stale` or `filtered` prompt says nothing of the reward)."""


class DroppedGroupGuard:
    """`observe(GroupOutcome)` for every group; raises once `limit` groups in a row were dropped (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.dropped: Counter[str] = Counter()
        """Groups dropped since the last one that reached the queue, by reason."""

    def observe(self, outcome: Any) -> None:
        if outcome.kept and outcome.num_samples > 0:
            self.dropped.clear()
        elif not outcome.kept and outcome.reason in DROPPED_REASONS:
            self.dropped[outcome.reason] += 1
            if self.limit and self.dropped.total() >= self.limit:
                raise NothingTrainedError(self._message())

    def _message(self) -> str:
        equal, unscorable = self.dropped["zero_std"], self.dropped["unscorable"]
        return (
            f"the last {self.dropped.total()} groups were all dropped before training ({equal} with every "
            f"rollout's reward equal, {unscorable} with fewer than two scorable rewards), so no sample reaches "
            "the trainer while the server keeps generating. `rollout/window_reward` says which case this is: at "
            "the top of the reward's range the prompts are solved (use harder prompts, or keep the last "
            "checkpoint); at the bottom they are out of reach (easier prompts, more num_generations, a higher "
            "temperature); a reward that never varies or returns None needs fixing. "
            f"max_groups_dropped_in_a_row={self.limit} sets this limit (0: never stop)"
        )
