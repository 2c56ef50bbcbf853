"""agrpo-trainer: see the package README for the map of modules and what to read first."""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

try:
    __version__ = _version("agrpo-trainer")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__: list[str] = []
