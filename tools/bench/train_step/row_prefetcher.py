"""`RowPrefetcher`: rows and tree plans prepared one micro-batch ahead on a worker thread.

The alternative to the trainer's inline preparation that `row_paths.py` measures (`thread`): the worker
runs `prepare_device_row` for micro-batch i+1 (`lookahead` rows ahead) while the caller's thread queues
micro-batch i's forward and backward. It queues its copies and kernels on the stream the caller computes
on (captured in `begin`), so every later kernel sees them complete; the caching allocator and torch's
pinned-host allocator keep stream order for reused blocks. Measured on an H200 no faster than preparing
inline (docs/benchmarks.md "The three row paths"), so the trainer does not use it. Does not know losses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from agrpo_packing import PackedRow
from agrpo_trainer._device_row import DeviceRow


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
