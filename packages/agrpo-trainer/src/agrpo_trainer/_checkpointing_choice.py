"""`CheckpointingChoice`: which activation checkpointing mode fits, decided from the first step's memory.

Owns `checkpointing_mode="auto"`. The first optimizer step runs `full` checkpointing (always safe), except
that on its first micro-batch `LayerProbe` runs decoder layer 0 without checkpointing, layer 1
selectively and layer 2 fully, and reads from the allocator how many bytes each kept per token (the
allocated memory after the layer minus before, minus its output; no device sync). At the end of that
step it has: allocated bytes at the step's start (weights), the peak before the optimizer step (plus
gradients and activations), allocated bytes after it (plus optimizer states), the largest row, and the
device's capacity (free device memory plus what this process's allocator holds). For each mode the
peak of later steps is predicted as

    after + (peak - start) * rows_scale + layers * max_row_tokens * (kept[mode] - kept["full"])

(`rows_scale` = the largest row allowed / the largest row seen, so a short first step does not fool it;
gradients are scaled too, which errs on the safe side), and the mode with the least recompute whose
prediction stays under 90% of the capacity is chosen (`none`, then `selective`, else `full`), mixed per layer
where a whole mode does not fit (`choose_layer_modes`), logged with the numbers. On a device without allocator statistics (CPU) `auto` stays `full`. With compiled
layers the probe costs the first step two more compiles (the `none` and `selective` graphs of the first
row's kind), which the choice may then reuse. Does not know how layers are compiled or checkpointed
(`_layer_region.py` applies the mode).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from ._activation_checkpointing import CHECKPOINT_MODES

logger = logging.getLogger("agrpo_trainer")

HEADROOM = 0.9
"""Share of the device's capacity a predicted peak may take (the rest absorbs fragmentation)."""
PROBED_MODES = ("none", "selective", "full")
"""The mode layer i runs on the probed micro-batch."""


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


@dataclass(slots=True)
class LayerProbe:
    """Bytes each checkpointing mode keeps per token of one decoder layer, read while the first step runs."""

    active: bool = False
    """True for the first micro-batch of the step being probed."""
    kept_per_token: dict[str, float] = field(default_factory=dict)
    """mode -> bytes kept for backward per token by one layer."""

    def mode_for(self, index: int) -> str | None:
        """The mode layer `index` runs now for the probe, or None (the regions' own mode)."""
        if not self.active or index >= len(PROBED_MODES) or PROBED_MODES[index] in self.kept_per_token:
            return None
        return PROBED_MODES[index]

    def before(self, device: torch.device) -> int | None:
        return _allocated(device)

    def after(self, mode: str, start: int | None, output: torch.Tensor, tokens: int) -> None:
        """Record what `mode` kept: allocated now minus `start` minus the layer's output."""
        now = _allocated(output.device)
        if start is None or now is None or tokens <= 0:
            return
        kept = now - start - output.numel() * output.element_size()
        self.kept_per_token[mode] = max(kept, 0) / tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryObservation:
    """What the first step measured (bytes, tokens)."""

    start: int
    """Allocated at the step's start: weights (and what the model holds)."""
    fwd_bwd_peak: int
    """Peak allocated before the optimizer step."""
    after: int
    """Allocated after the step: weights and optimizer states."""
    capacity: int
    """Free device memory plus what this process's allocator reserves."""
    row_tokens: int
    """Largest row of the step."""
    max_row_tokens: int
    """Largest row later steps may bring (the token budget), >= row_tokens."""
    num_layers: int
    """Checkpointed decoder layers."""
    kept_per_token: dict[str, float]
    """mode -> bytes one layer keeps per token (`LayerProbe`)."""


def predicted_peaks(obs: MemoryObservation) -> dict[str, float]:
    """Predicted peak allocated bytes of a later step, per probed mode (see the module docstring)."""
    scale = obs.max_row_tokens / max(obs.row_tokens, 1)
    base = obs.after + (obs.fwd_bwd_peak - obs.start) * scale
    full = obs.kept_per_token.get("full", 0.0)
    return {
        mode: base + obs.num_layers * obs.max_row_tokens * (kept - full)
        for mode, kept in obs.kept_per_token.items()
    }


def choose_layer_modes(obs: MemoryObservation) -> tuple[str, ...]:
    """Each layer's mode: the least recompute whose predicted peak fits under `HEADROOM` of the capacity, mixed
    per layer where a whole mode does not fit. Memory grows by layer, so when `none` does not fit but `selective`
    does, as many layers as fit run `none` and the rest `selective`; when only `full` fits, as many as fit run
    `selective` and the rest `full` (a 4B model's 64k-token rows: full alone recomputes a third more than it
    must). The less-recompute layers come first."""
    peaks, limit = predicted_peaks(obs), HEADROOM * obs.capacity
    layers = obs.num_layers
    for more, less in (("none", "selective"), ("selective", "full")):
        if less not in peaks or more not in peaks or peaks[less] > limit:
            continue
        if peaks[more] <= limit:
            return (more,) * layers
        per_layer = (
            peaks[more] - peaks[less]
        ) / layers  # what one layer adds switching from `less` to `more`
        count = int((limit - peaks[less]) // per_layer) if per_layer > 0 else layers
        return (more,) * count + (less,) * (layers - count)
    return ("full",) * layers


def describe(modes: tuple[str, ...]) -> str:
    """ "selective" for one mode, else "selective for 20 of 36 layers, full for 16"."""
    counts = {m: modes.count(m) for m in dict.fromkeys(modes)}
    if len(counts) == 1:
        return modes[0] if modes else "full"
    return ", ".join(
        f"{m} for {n}" + (f" of {len(modes)} layers" if i == 0 else "")
        for i, (m, n) in enumerate(counts.items())
    )


class CheckpointingChoice(TrainerCallback):
    """Runs the first step under `full` with the probe, then sets the chosen mode on the layer regions."""

    def __init__(self, regions) -> None:
        self.regions = regions
        self.pending = regions.settings.checkpointing == "auto"
        self._start = self._peak = 0

    def on_step_begin(self, args, state, control, **kwargs):
        device = self.regions.device
        if not self.pending or device is None:
            return
        if device.type != "cuda":
            self.pending = False
            logger.info(
                "checkpointing_mode=auto: no allocator statistics on %s; checkpointing stays full", device
            )
            return
        torch.cuda.reset_peak_memory_stats(device)
        self._start = torch.cuda.memory_allocated(device)
        self.regions.probe.active = True

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.pending and self.regions.device is not None and self.regions.device.type == "cuda":
            self._peak = torch.cuda.max_memory_allocated(self.regions.device)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.pending or self.regions.device is None:
            return
        self.pending = False
        self.regions.set_layer_modes(self.decide())

    def decide(self) -> tuple[str, ...]:
        """Each layer's mode from this step's measurements, logged with the predictions."""
        device, probe = self.regions.device, self.regions.probe
        probe.active = False
        free, _ = torch.cuda.mem_get_info(device)
        rows = self.regions.largest_row
        obs = MemoryObservation(
            start=self._start, fwd_bwd_peak=self._peak, after=torch.cuda.memory_allocated(device),
            capacity=free + torch.cuda.memory_reserved(device), row_tokens=rows,
            max_row_tokens=max(rows, self.regions.max_row_tokens or int(1.25 * rows)),
            num_layers=self.regions.num_layers, kept_per_token=dict(probe.kept_per_token),
        )  # fmt: skip
        modes = choose_layer_modes(obs)
        peaks = ", ".join(f"{m} {p / 2**30:.1f} GiB" for m, p in predicted_peaks(obs).items())
        logger.info(
            "checkpointing_mode=auto chose %s: predicted peaks %s for rows up to %d tokens; capacity %.1f GiB "
            "(first step peak %.1f GiB with full checkpointing)",
            describe(modes), peaks, obs.max_row_tokens, obs.capacity / 2**30, obs.fwd_bwd_peak / 2**30,
        )  # fmt: skip
        assert set(modes) <= set(CHECKPOINT_MODES)
        return modes
