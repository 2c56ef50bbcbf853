"""`DeviceRow`: one micro-batch's packed row on the model's device with its tree plan; `RowPrefetcher`
prepares the next ones on a worker thread while the current one trains.

Owns the host-to-device side of a micro-batch. `prepare_device_row` builds the row's tree plan
(`build_tree_plan(..., non_blocking=True)`: host index work, copies queued through pinned memory, the
attention backend's device-side prepare) and copies the row's tensors the same way, so nothing in it
waits for the GPU to finish the work already queued. Before, `token_scores` built the plan and copied
the row from pageable memory between micro-batches, and each such copy synchronised the stream (on an
H200 this showed as an occasional 20-26% idle step; the steady 3.5-4.5% idle that remains is kernel
launch gaps inside the forward and backward, docs/benchmarks.md "Train step").
`RowPrefetcher` runs `prepare_device_row` for micro-batch i+1 (`lookahead` rows ahead) on one worker
thread while the trainer's thread queues micro-batch i's forward and backward.

Correctness: the worker queues its copies and kernels on the stream the trainer computes on (captured in
`begin`), so every later kernel sees them complete, and a block the caching allocator hands back for a
later copy is only overwritten after every kernel queued before it (stream order); torch's pinned-host
allocator keeps a staging buffer until its copy ran. The tensors are made by the same operations as in
the trainer's thread (`prepare_device_row` called directly is the sequential reference), so results are
bit-identical. An error on the worker is raised by `take` of that row. Does not know losses,
optimizers or where rows come from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


class RowPrefetcher:
    """One optimizer step's rows prepared in order on a worker thread: `begin(rows)`, then `take(i)` for
    i = 0, 1, ...; the worker stays `lookahead` rows ahead of the last `take`. `close` ends the worker."""

    def __init__(
        self, prepare: Callable[[PackedRow], DeviceRow], device: torch.device | str, *, lookahead: int = 1
    ) -> None:
        self.prepare = prepare
        self.device = torch.device(device)
        self.lookahead = lookahead
        self._rows: Sequence[PackedRow] = ()
        self._futures: list[Future] = []
        self._stream: torch.cuda.Stream | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agrpo-rows")

    def begin(self, rows: Sequence[PackedRow]) -> None:
        """Start preparing a new step's rows (a previous step's rows not yet started are dropped)."""
        for future in self._futures:
            future.cancel()
        self._rows, self._futures = rows, []
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._submit_until(self.lookahead)

    def take(self, index: int) -> DeviceRow:
        """Row `index` of the step, prepared (waits for the worker; raises what it raised)."""
        if not 0 <= index < len(self._rows):
            raise IndexError(
                f"take({index}) but this step has {len(self._rows)} rows: call begin(rows) first"
            )
        self._submit_until(index + self.lookahead)
        return self._futures[index].result()

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._executor.shutdown(wait=True)

    def _submit_until(self, last: int) -> None:
        while len(self._futures) <= min(last, len(self._rows) - 1):
            self._futures.append(self._executor.submit(self._prepare, self._rows[len(self._futures)]))

    def _prepare(self, row: PackedRow) -> DeviceRow:
        if self._stream is None:
            return self.prepare(row)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            return self.prepare(row)
