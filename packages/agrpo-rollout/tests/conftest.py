"""Fixtures of agrpo-rollout's tests: configs pointed at the session's real vLLM server."""

from __future__ import annotations

import pytest

from agrpo_rollout import RolloutConfig


@pytest.fixture
def server_config(vllm_server):
    """A factory of small, fast `RolloutConfig`s for the shared CPU vLLM server."""

    def make(**overrides) -> RolloutConfig:
        fields = {
            "vllm_server_base_url": vllm_server.url,
            "num_generations": 2,
            "max_completion_length": 12,
            "max_concurrent_rollouts": 8,
            "metrics_poll_interval_s": 0.2,
            "metrics_interval_s": 0.2,
            "vllm_retry_backoff_s": 0.05,
        }
        fields.update(overrides)
        return RolloutConfig(**fields)

    return make
