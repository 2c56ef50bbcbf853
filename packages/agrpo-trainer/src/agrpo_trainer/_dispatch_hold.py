"""`DispatchHold`: the producer held at `max_staleness`, so no group is generated that the trainer would drop.

A sample is trained in FIFO order behind every sample issued before it. If the trainer takes S samples per
optimizer step and pushes a version every w steps, a group dispatched right after a push, with O samples
issued ahead of it and not yet taken, has its last sample trained about (O + G) / S steps later, at a version
(O + G) / (S w) newer than its own. So it may start only while O stays under (max_staleness + 1) S w; while a
step is being computed (taken, not pushed yet) a new group still carries the version before that step's push,
which costs one version: the window is then max_staleness S w. Groups finish out of order (one that ends late is
trained behind groups dispatched after it), so with max_staleness > 0 half a step of the window is kept free. The trainer publishes the allowance (samples
gone from the queue so far, taken or dropped, plus the window) after each take and each push; the rollout
process compares it with what it has issued (a group counts G samples until its outcome says how many it
yielded) and starts a group only when all of it fits.

S is measured (mean samples per finished step, starting from the configured count), and widened when the
trainer has waited for samples a second after a publish while the producer is held (the window was too small
to fill a step; a trainer waiting on slow generation widens nothing). Groups that straddle two steps, forks
and varying row fills make it an estimate, so a few samples can still go stale; in steady state
`sample/dropped_stale_total` stays at or near 0 instead of a step's worth per step. Does not know processes.
"""

from __future__ import annotations

from typing import Any

_EMA = 0.3
_ORDER_MARGIN = 0.5
"""Steps of the window kept free for groups that finish after groups dispatched behind them."""


class DispatchHold:
    """The sample allowance the producer may have issued in all, updated by the pipeline."""

    def __init__(self, *, max_staleness: int, weight_sync_steps: int, samples_per_step: float) -> None:
        self.max_staleness = max_staleness
        self.weight_sync_steps = max(1, weight_sync_steps)
        self.samples_per_step = max(1.0, float(samples_per_step))

    def observe_step(self, samples: int) -> None:
        """A finished optimizer step trained `samples`: refine S."""
        if samples > 0:
            self.samples_per_step += _EMA * (samples - self.samples_per_step)

    def starved(self) -> None:
        """The trainer waited for samples while the producer may have been held: S was too small (a step
        needs more samples than measured, e.g. rows filled by tokens): widen the window."""
        self.samples_per_step *= 1.25

    @classmethod
    def for_run(cls, args, num_ranks: int) -> DispatchHold:
        """From the trainer's config: S starts at the configured samples per step (refined once measured)."""
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_ranks
        return cls(
            max_staleness=args.max_staleness,
            weight_sync_steps=args.weight_sync_steps,
            samples_per_step=per_step,
        )

    def allowance(self, gone: int, *, step_running: bool) -> int:
        """Samples the producer may have issued in all: those `gone` from the queue (handed to a step, or
        dropped stale or oversize) plus the window for what stays trainable."""
        versions = self.max_staleness + (0 if step_running else 1)
        if (
            self.max_staleness > 0
        ):  # groups finish out of order: one finishing late is trained after later ones
            versions -= _ORDER_MARGIN
        return gone + int(versions * self.samples_per_step * self.weight_sync_steps)


class IssuedSamples:
    """The rollout process's side: samples it has dispatched or will queue, against the trainer's allowance.

    A group counts G samples from its draw until its outcome says how many it yielded (0 when dropped);
    a filtered prompt was never dispatched. `allowance` and `held` are shared values (the trainer sets the
    first and reads the second)."""

    def __init__(self, per_group: int, allowance: Any, held: Any) -> None:
        self.per_group, self.allowance, self.held = per_group, allowance, held
        self.count = 0

    def draw(self) -> None:
        self.count += self.per_group

    def outcome(self, outcome: Any) -> None:
        if outcome.reason != "filtered":
            self.count += outcome.num_samples - self.per_group

    def may_dispatch(self) -> bool:
        """A group starts when all of it fits (the trainer widens a window too small to fill a step)."""
        self.held.value = int(self.count + self.per_group > self.allowance.value)
        return not self.held.value
