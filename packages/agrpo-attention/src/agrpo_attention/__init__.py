"""agrpo-attention: tree attention and tree Gated DeltaNet for transformers decoders on packed prefix-tree rows.

See the package README for the map of modules and what to read first. Names load lazily on first
access, so `import agrpo_attention` stays free of torch (and of torch.distributed, which torch imports).
"""

from importlib import import_module as _import_module
from importlib.metadata import version as _version

__version__ = _version("agrpo-attention")

_EXPORTS = {
    "BackendUnavailableError": "._exceptions",
    "TreeAttentionError": "._exceptions",
    "TreePlan": "._tree_plan",
    "TreePlanMissingError": "._exceptions",
    "UnsupportedModelError": "._exceptions",
    "available_backends": "._backends",
    "build_tree_plan": "._tree_plan",
    "enable_tree_attention": "._model_patch",
    "gathered_logprobs": "._token_logprobs",
    "token_logprobs": "._token_logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agrpo_attention' has no attribute {name!r}")
    value = getattr(_import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
