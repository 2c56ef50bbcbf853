"""Rank 0's values on every rank: the few collectives the trainer's own control flow needs.

Owns `rank_world`, `share` (broadcast an object from rank 0) and `scatter` (rank r gets rank 0's r-th
object), each a no-op without a process group. Rank 0 owns the rollout process and the packing thread, so
micro-batch rows, the step's token count and the stop decision travel this way; gradients and weights do
not (the Trainer's DDP/FSDP2 and agrpo-sync move those). Does not know what the objects are.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    rank, world = rank_world()
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter(payloads: list[Any] | None) -> Any:
    """Rank r gets `payloads[r]` (given on rank 0 only)."""
    rank, world = rank_world()
    if world == 1:
        return payloads[0]
    out = [None]
    dist.scatter_object_list(out, payloads if rank == 0 else None, src=0)
    return out[0]
