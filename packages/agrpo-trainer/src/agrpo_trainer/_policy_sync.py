"""`PolicySync`: the trainer's policy version, and the weight pushes that advance it (SPEC F-SYNC, F-BEYOND).

Owns the version counter and its one rule: a version exists for the rollout process only once the
server serves it, so `push` returns the new version after `agrpo_sync.WeightSync.sync` returned (the
server resumed on the new weights) and the caller publishes it then. Also owns the post-sync parity
probe and its warning. Every rank calls `start` and `push` (FSDP2 ranks join the gathers); only rank 0
talks to the server. Does not know when to push (`weight_sync_steps` is the trainer's) nor the rollout
process.
"""

from __future__ import annotations

import logging

import httpx
import numpy as np
import torch
import torch.distributed as dist

from agrpo_sync import WeightSync, WeightSyncConfig

from ._parity_probe import ParityProbe
from ._ranks import share

logger = logging.getLogger("agrpo_trainer")


def _is_main_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _first_served_model(base_url: str, timeout_s: float = 30.0) -> dict:
    with httpx.Client(timeout=timeout_s) as client:
        response = client.get(f"{base_url.rstrip('/')}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]


def served_base_model(base_url: str) -> str:
    """The first model name the server lists (the weights full-weight syncs replace)."""
    return _first_served_model(base_url)["id"]


def served_max_model_len(base_url: str) -> int:
    """The server's context length (`token_budget=None` packs rows up to it)."""
    return int(_first_served_model(base_url)["max_model_len"])


class PolicySync:
    """Pushes the policy; `version` is what the server serves (0 before the first push)."""

    def __init__(
        self, weight_sync: WeightSync, *, probe: ParityProbe | None, threshold: float, base_model: str | None
    ) -> None:
        self.weight_sync = weight_sync
        self.probe = probe
        self.threshold = threshold
        self.base_model = base_model
        self.version = 0

    @classmethod
    def start(
        cls, config: WeightSyncConfig, model: torch.nn.Module, *, probe: ParityProbe | None, threshold: float
    ) -> PolicySync:
        """Check the server and set up the transfer (every rank)."""
        weight_sync = WeightSync.start(config, model)
        base = served_base_model(config.base_url) if _is_main_rank() else None
        return cls(weight_sync, probe=probe, threshold=threshold, base_model=base)

    def served_model(self, version: int | None = None) -> str | None:
        """The `model` requests must name to be served `version` (an adapter name under adapter sync)."""
        version = self.version if version is None else version
        return self.weight_sync.served_model(version) or self.base_model

    def push(self, model: torch.nn.Module) -> dict[str, float]:
        """Send the weights as the next version; returns `perf/weight_sync_*` and `sync/*` metrics."""
        timings = self.weight_sync.sync(model, self.version + 1)
        self.version += 1
        metrics = timings.metrics()
        if self.probe is not None:
            metrics.update(self._parity(model))
        return metrics

    def _parity(self, model: torch.nn.Module) -> dict[str, float]:
        sampled = self.probe.server_sample(self.served_model()) if _is_main_rank() else None
        continuation, server_side = share(sampled)
        trainer_side = self.probe.trainer_logprobs(model, continuation)  # every rank: sharded models gather
        if not _is_main_rank():
            return {}
        gap = float(np.max(np.abs(server_side - trainer_side)))
        if gap > self.threshold:
            logger.warning(
                "after syncing version %d the server's log-probs of the parity probe differ from the trainer's by "
                "up to %.3g nats (sync_parity_threshold=%g): the server may not serve the trainer's weights "
                "(a failed or partial sync, a restarted server) or runs another dtype (compare --dtype with the "
                "trainer's)",
                self.version,
                gap,
                self.threshold,
            )
        mean_gap = float(np.mean(np.abs(server_side - trainer_side)))
        return {"sync/logprob_max_abs_diff": gap, "sync/logprob_mean_abs_diff": mean_gap}

    def close(self) -> None:
        self.weight_sync.close()
