"""`RequestSeeds`: the reproducible sampling seeds of one rollout's requests (`RolloutConfig.seed`).

Owns how a request's seed is derived: from the base seed, the prompt's epoch and row, the rollout's
index in its group and the request's index in the rollout (numpy's `SeedSequence` mixes them), so a
seeded run repeats whatever order requests happen to be sent in, and the rollouts of a group still
differ (one seed for every request would make them identical). Does not know HTTP: the loop sets
`REQUEST_SEEDS` when it spawns a rollout (each rollout's task copies it), the client draws a seed per
sampling request (a retry reuses its request's seed).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestSeeds:
    """The seeds of one rollout's sampling requests, in request order."""

    base: int
    epoch: int = 0
    row_index: int = 0
    generation: int = 0
    """The rollout's index in its group."""
    issued: int = 0
    """Seeds drawn so far."""

    def next(self) -> int:
        """The next request's seed, in [0, 2**31)."""
        entropy = [self.base, self.epoch, self.row_index, self.generation, self.issued]
        self.issued += 1
        return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


REQUEST_SEEDS: ContextVar[RequestSeeds | None] = ContextVar("agrpo_request_seeds", default=None)
"""The seeds of the rollout a request belongs to; None outside a seeded loop."""
