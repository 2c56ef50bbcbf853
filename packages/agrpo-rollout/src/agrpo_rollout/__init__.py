"""agrpo-rollout: see the package README for the map of modules and what to read first."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._assistant_message import AssistantMessage
from ._client import VLLMClient, check_routed_experts
from ._completion_response import decode_completion, decode_generate
from ._concurrency import ConcurrencyController
from ._config import RolloutConfig
from ._exceptions import (
    DatasetError,
    PromptsExhaustedError,
    RequestRejectedError,
    ResponseFormatError,
    RolloutError,
    ServerConfigError,
    ServerError,
    ServerLostError,
    ServerUnavailableError,
    ToolSetupError,
)
from ._group import RolloutGroup, group_advantages, is_trainable
from ._group_outcome import GroupOutcome
from ._loop import AsyncRolloutLoop
from ._rollout import Rollout
from ._routed_experts import ExpertRouting
from ._sample import PACK_FIELDS, RolloutSample
from ._sequence import ReconcileStats, TrainingSequence, build_sequences
from ._server import ServerInfo
from ._server_event import ServerEvent
from ._server_load import ServerLoad
from ._toolbox import Toolbox, ToolOutcome
from ._turn import TopLogprobs, TurnRecord

try:
    __version__ = _version("agrpo-rollout")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__ = [
    "AssistantMessage",
    "AsyncRolloutLoop",
    "ConcurrencyController",
    "DatasetError",
    "ExpertRouting",
    "GroupOutcome",
    "PACK_FIELDS",
    "PromptsExhaustedError",
    "ReconcileStats",
    "RequestRejectedError",
    "ResponseFormatError",
    "Rollout",
    "RolloutConfig",
    "RolloutError",
    "RolloutGroup",
    "RolloutSample",
    "ServerConfigError",
    "ServerError",
    "ServerEvent",
    "ServerInfo",
    "ServerLoad",
    "ServerLostError",
    "ServerUnavailableError",
    "ToolOutcome",
    "ToolSetupError",
    "Toolbox",
    "TopLogprobs",
    "TrainingSequence",
    "TurnRecord",
    "VLLMClient",
    "build_sequences",
    "check_routed_experts",
    "decode_completion",
    "decode_generate",
    "group_advantages",
    "is_trainable",
]
