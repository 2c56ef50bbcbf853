"""agrpo-rollout: see the package README for the map of modules and what to read first."""

from importlib.metadata import version as _version

__version__ = _version("agrpo-rollout")

__all__: list[str] = []
