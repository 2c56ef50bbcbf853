"""`GroupOutcome`: what became of one drawn prompt, as the loop reports it to `on_group`.

Owns the record. Every drawn prompt gets exactly one: kept (its samples went to the sink), dropped
(`zero_std`, `unscorable`), `filtered` by `filter_prompt`, or `stale`: the server unloaded the adapter
of its policy version (LoRA window) before the group finished. Epoch counting and a trainer's resume
position are built on these; the loop does not know how they are used.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._group import RolloutGroup


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """What became of one drawn prompt; `on_group` receives one per prompt (epoch accounting)."""

    row_index: int
    epoch: int
    group_id: int
    """-1 for a prompt `filter_prompt` rejected."""
    kept: bool
    reason: str
    """"" when kept; `filtered`, `zero_std`, `unscorable` or `stale` otherwise."""
    num_samples: int
    group: RolloutGroup | None
