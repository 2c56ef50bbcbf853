"""Freezes agrpo-trainer's public surface (style.md habit 14): growing it is a reviewed decision."""

import agrpo_trainer

EXPECTED = ["AsyncGRPOConfig", "AsyncGRPOError", "AsyncGRPOTrainer", "ModelSetupError", "NothingTrainedError",
            "RolloutWorkerError"]


def test_exported_api_is_frozen():
    assert agrpo_trainer.__all__ == EXPECTED
