"""The errors agrpo-packing raises on purpose.

Owns the hierarchy; every error here is a user error (wrong input or a call out of order), so each
subclasses `ValueError` as well and its message names the fix. Internal invariants use `assert`.

    ValueError
    └── PackingError          anything agrpo-packing refuses
        └── RowFullError      `TreeRow.add` of a sample that `TreeRow.fits` would have refused
"""

from __future__ import annotations


class PackingError(ValueError):
    """A request agrpo-packing refuses; the message says what to change."""


class RowFullError(PackingError):
    """`TreeRow.add` was given a sample the row has no budget for; check `fits` first or open a new row."""
