"""`PolicySync`: the trainer's policy version, and the weight pushes that advance it (SPEC F-SYNC, F-BEYOND).

Owns the version counter and its one rule: a version exists for the rollout process only once the
servers serve it, so `push` returns the new version after `agrpo_sync.WeightSync.sync` returned (every
server of the sync resumed on the new weights; with several servers, those that did not answer are left
out and rejoined later, `sync/servers_serving` counts the others) and the caller publishes it then. Also
owns the post-sync parity probe, run on every server that got the version, and its warning, and the
question the trainer asks when the rollout side reports a server behind (`needs_resync`: it answers but
does not hold the last version, e.g. it restarted). Every rank calls `start` and `push` (FSDP2 ranks join
the gathers and the probe's forward); only rank 0 talks to the servers. Does not know when to push
(`weight_sync_steps` and re-syncs are the trainer's) nor the rollout process.
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
    """Pushes the policy; `version` is what the servers serve (0 before the first push)."""

    def __init__(
        self,
        weight_sync: WeightSync,
        *,
        probes: list[ParityProbe] | None,
        threshold: float,
        base_model: str | None,
    ) -> None:
        self.weight_sync = weight_sync
        self.probes = probes
        """One parity probe per server (index as in `vllm_server_base_url`), or None."""
        self.threshold = threshold
        self.base_model = base_model
        self.version = 0

    @classmethod
    def start(
        cls,
        config: WeightSyncConfig,
        model: torch.nn.Module,
        *,
        threshold: float,
        probe_ids: list[int] | None = None,
        probe_timeout_s: float = 120.0,
    ) -> PolicySync:
        """Check the servers and set up the transfer (every rank); with `probe_ids`, one parity probe per
        server scores them after every push."""
        weight_sync = WeightSync.start(config, model)
        base = served_base_model(config.server_urls[0]) if _is_main_rank() else None
        probes = None
        if probe_ids is not None:
            probes = [ParityProbe(url, probe_ids, timeout_s=probe_timeout_s) for url in config.server_urls]
        return cls(weight_sync, probes=probes, threshold=threshold, base_model=base)

    def served_model(self, version: int | None = None) -> str | None:
        """The `model` requests must name to be served `version` (an adapter name under adapter sync)."""
        version = self.version if version is None else version
        return self.weight_sync.served_model(version) or self.base_model

    @property
    def num_servers(self) -> int:
        return len(self.weight_sync.config.server_urls)

    def push(self, model: torch.nn.Module) -> dict[str, float]:
        """Send the weights as the next version; returns `perf/weight_sync_*` and `sync/*` metrics."""
        timings = self.weight_sync.sync(model, self.version + 1)
        self.version += 1
        metrics = timings.metrics()
        members = share(sorted(self.weight_sync.members) if _is_main_rank() else None)
        if self.num_servers > 1:
            metrics["sync/servers_serving"] = float(len(members))
        if self.probes is not None:
            metrics.update(self._parity(model, members))
        return metrics

    def needs_resync(self, servers: set[int]) -> bool:
        """Whether any of `servers` answers but does not hold the last version pushed (rank 0)."""
        return any(self.weight_sync.needs_resync(index) for index in sorted(servers))

    def _parity(self, model: torch.nn.Module, members: list[int]) -> dict[str, float]:
        sampled = self._server_samples(members) if _is_main_rank() else None
        gaps = {}
        for index, (continuation, server_side) in share(sampled):
            trainer_side = self.probes[index].trainer_logprobs(
                model, continuation
            )  # every rank: sharded models gather
            gaps[index] = np.abs(server_side - trainer_side)
        if not _is_main_rank() or not gaps:
            return {}
        for index, gap in gaps.items():
            if float(gap.max()) > self.threshold:
                logger.warning(
                    "after syncing version %d the log-probs of %s for the parity probe differ from the trainer's by "
                    "up to %.3g nats (sync_parity_threshold=%g): the server may not serve the trainer's weights "
                    "(a failed or partial sync, a restarted server) or runs another dtype (compare --dtype with the "
                    "trainer's)",
                    self.version, self.probes[index].base_url, float(gap.max()), self.threshold,
                )  # fmt: skip
        out = {
            "sync/logprob_max_abs_diff": max(float(gap.max()) for gap in gaps.values()),
            "sync/logprob_mean_abs_diff": float(np.mean([float(gap.mean()) for gap in gaps.values()])),
        }
        if self.num_servers > 1:
            out.update({f"sync/server/{i}/logprob_max_abs_diff": float(gap.max()) for i, gap in gaps.items()})
        return out

    def _server_samples(self, members: list[int]) -> list[tuple[int, tuple[list[int], np.ndarray]]]:
        """The probe's continuation on every server that got the version; one that stopped answering since
        is skipped (it is rejoined, and probed, after its re-sync)."""
        sampled = []
        for index in members:
            try:
                sampled.append((index, self.probes[index].server_sample(self.served_model())))
            except httpx.TransportError as error:
                logger.warning(
                    "the parity probe could not reach %s (%s); skipped for version %d",
                    self.probes[index].base_url, error, self.version,
                )  # fmt: skip
        return sampled

    def close(self) -> None:
        self.weight_sync.close()
