"""`SyncTimings`: where the time of one weight sync went, as the trainer logs it (`perf/weight_sync_*`).

Owns the record and its metric names. Does not know how a sync runs (`_weight_sync.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncTimings:
    """Wall-clock parts of one sync on the calling rank, in seconds."""

    weight_sync_s: float
    """Everything the trainer waits for: stage, pause, barrier, transfer, resume."""
    stage_s: float
    """Before generation pauses: the pre-flight check and what the backend writes ahead (the disk checkpoint)."""
    pause_s: float
    barrier_s: float
    transfer_s: float
    """Gather, send, and the server loading the weights (its `finish` or reload included)."""
    generation_paused_s: float
    """How long generation was paused, from the `/pause` request to the `/resume` answer (0 without a pause)."""
    num_bytes: int
    """Bytes sent (0 on ranks that only joined the gather)."""
    peak_gather_bytes: int
    """Largest bucket of full tensors this rank held at once, in bytes (bounded by `gather_bucket_bytes`
    unless one tensor is larger)."""
    retries: int = 0
    """Complete re-sends after a failed attempt left the server's weights mixed (0 or 1)."""

    def metrics(self) -> dict[str, float]:
        return {
            "perf/weight_sync_s": self.weight_sync_s,
            "perf/weight_sync_stage_s": self.stage_s,
            "perf/weight_sync_pause_s": self.pause_s,
            "perf/weight_sync_barrier_s": self.barrier_s,
            "perf/weight_sync_transfer_s": self.transfer_s,
            "perf/weight_sync_retries": float(self.retries),
            "perf/weight_sync_generation_paused_s": self.generation_paused_s,
        }
