"""agrpo-packing: see the package README for the map of modules and what to read first."""

from importlib.metadata import version as _version

__version__ = _version("agrpo-packing")

__all__: list[str] = []
