"""`DeviceRow`: one micro-batch's packed row on the model's device with its tree plan.

Owns the host-to-device side of a micro-batch. `prepare_device_row` builds the row's tree plan
(`build_tree_plan(..., non_blocking=True)`: host index work, copies queued through pinned memory, the
attention backend's device-side prepare) and copies the row's tensors the same way, so nothing in it
waits for the GPU to finish the work already queued. The trainer calls it in `compute_loss`, on the
training thread, just before the row's forward. Before, `token_scores` built the plan and copied the row
from pageable memory, and each such copy synchronised the stream (on an H200 an occasional 20-26% idle
step). Preparing the next row on a worker thread instead was measured and bought nothing (0.98-0.99x of
the sequential step at ratio 8, where inline was 0.99x; inline 0.95-0.97x at ratio 1, the thread
0.98-0.99x; docs/benchmarks.md "The three row paths"): the pinned, non-blocking copy is what matters, so
there is no thread. The tensors are made by the same operations as the sequential path, so losses and
gradients are bit-identical. Does not know losses, optimizers or where rows come from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from agrpo_attention import TreePlan, build_tree_plan
from agrpo_packing import PackedRow


@dataclass(frozen=True, slots=True)
class DeviceRow:
    """A packed row ready for `micro_batch_loss(..., plan=...)`."""

    row: PackedRow
    """The row, every tensor on the model's device."""
    plan: TreePlan | None
    """Its tree plan; None for a row without loss terms (`token_scores` runs no forward for it)."""


def _tree_model(model: torch.nn.Module) -> torch.nn.Module:
    """The tree-enabled model inside a data-parallel wrapper that keeps it as `.module` (DDP)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _pinned(row: PackedRow) -> PackedRow:
    """A copy of `row` whose tensors live in pinned host memory (so copies from it can be asynchronous)."""
    tensors = {f.name: getattr(row, f.name) for f in fields(row)}
    return replace(
        row, **{name: t.pin_memory() for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    )


def prepare_device_row(row: PackedRow, model: torch.nn.Module) -> DeviceRow:
    """`row` (host tensors) and its tree plan on `model`'s device; on CUDA every copy is queued on the
    current stream through pinned memory, without waiting for the GPU."""
    inner = _tree_model(model)
    device = next(inner.parameters()).device
    non_blocking = device.type == "cuda"
    plan = build_tree_plan(row, inner, non_blocking=non_blocking) if row.num_loss_terms else None
    staged = _pinned(row) if non_blocking else row
    return DeviceRow(row=staged.to(device, non_blocking=non_blocking), plan=plan)
