"""agrpo-packing: prefix-tree packing of training sequences that share prefixes.

See the package README for the map of modules and what to read first. Test helpers (hypothesis
strategy, seeded GRPO data, the packed-equals-alone assertion) live in the public submodule
`agrpo_packing.testing`.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from ._exceptions import PackingError, RowFullError
from ._micro_batch import MicroBatch
from ._packed_row import PackedRow
from ._packing_config import PackingConfig
from ._planner import Planner
from ._row_reference import UnpackedSample, reference_logprobs, token_path, unpack
from ._sample import PackSample
from ._sft_collator import SFTCollator
from ._tree_row import TreeRow

try:
    __version__ = _version("agrpo-packing")
except _PackageNotFoundError:  # run from a source tree on PYTHONPATH (e.g. the GPU machine), not installed
    __version__ = "0+source"

__all__ = [
    "MicroBatch",
    "PackSample",
    "PackedRow",
    "PackingConfig",
    "PackingError",
    "Planner",
    "RowFullError",
    "SFTCollator",
    "TreeRow",
    "UnpackedSample",
    "reference_logprobs",
    "token_path",
    "unpack",
]
