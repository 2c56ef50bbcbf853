"""agrpo-trainer: asynchronous GRPO; see the package README for the map of modules and what to read first.

`from agrpo_trainer import AsyncGRPOTrainer, AsyncGRPOConfig`; reward functions live in the public submodule
`agrpo_trainer.rewards`; the rollout loop to subclass is `agrpo_rollout.AsyncRolloutLoop`.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._config import AsyncGRPOConfig
from ._exceptions import AsyncGRPOError, ModelSetupError, NothingTrainedError, RolloutWorkerError
from ._trainer import AsyncGRPOTrainer

try:
    __version__ = _version("agrpo-trainer")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOError",
    "AsyncGRPOTrainer",
    "ModelSetupError",
    "NothingTrainedError",
    "RolloutWorkerError",
]
