"""agrpo-packing: prefix-tree packing of training sequences that share prefixes.

See the package README for the map of modules and what to read first.
"""

from importlib.metadata import version as _version

from ._packed_row import PackedRow
from ._sample import PackSample

__version__ = _version("agrpo-packing")

__all__ = ["PackSample", "PackedRow"]
