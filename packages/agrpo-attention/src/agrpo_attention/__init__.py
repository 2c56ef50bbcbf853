"""agrpo-attention: see the package README for the map of modules and what to read first."""

from importlib.metadata import version as _version

__version__ = _version("agrpo-attention")

__all__: list[str] = []
