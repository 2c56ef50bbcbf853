"""The errors agrpo-attention raises, all user errors that name their fix.

    TreeAttentionError                      (base; catch this for "anything from agrpo-attention")
    ├── UnsupportedModelError (ValueError)  the model has a layer or setting tree attention cannot run
    ├── BackendUnavailableError (ValueError) the requested backend's kernel is not importable here
    └── TreePlanMissingError (ValueError)   a tree-enabled model was called without its tree plan

Owns nothing else. Does not know which backends exist (the backend table does).
"""

from __future__ import annotations


class TreeAttentionError(Exception):
    """Base class of every error raised by agrpo-attention."""


class UnsupportedModelError(TreeAttentionError, ValueError):
    """The model has a layer type, attention variant or setting that tree attention does not support."""


class BackendUnavailableError(TreeAttentionError, ValueError):
    """The requested attention backend cannot run on this machine (kernel missing, wrong device)."""


class TreePlanMissingError(TreeAttentionError, ValueError):
    """A model switched to tree attention was called without a tree plan (use `token_logprobs`)."""
