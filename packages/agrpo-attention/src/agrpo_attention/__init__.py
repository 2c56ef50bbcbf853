"""agrpo-attention: tree attention and tree Gated DeltaNet for transformers decoders on packed prefix-tree rows.

See the package README for the map of modules and what to read first.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._backends import available_backends
from ._exceptions import (
    BackendUnavailableError,
    TreeAttentionError,
    TreePlanMissingError,
    UnsupportedModelError,
)
from ._model_patch import deltanet_traceable, enable_tree_attention
from ._routing_replay import RoutingReplaySettings, enable_routing_replay
from ._token_logprobs import TokenScores, gathered_logprobs, token_logprobs, token_scores
from ._tree_plan import TreePlan, build_tree_plan

try:
    __version__ = _version("agrpo-attention")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__ = [
    "BackendUnavailableError",
    "RoutingReplaySettings",
    "TokenScores",
    "TreeAttentionError",
    "TreePlan",
    "TreePlanMissingError",
    "UnsupportedModelError",
    "available_backends",
    "build_tree_plan",
    "deltanet_traceable",
    "enable_routing_replay",
    "enable_tree_attention",
    "gathered_logprobs",
    "token_logprobs",
    "token_scores",
]
