"""`CompileNotice`: say, once, that the first optimizer step compiles the decoder layers and what that cost.

A compiled run's first step takes minutes on a GPU (inductor generates and autotunes Triton kernels per kind
of row) where later steps take seconds; without a word the bar looks hung. Printed on the main process to
stderr, not logged: the `agrpo_trainer` logger's info lines are off by default, and this is no warning.
Does not compile anything (`_layer_region` does).
"""

from __future__ import annotations

import sys
import time

from transformers import TrainerCallback


class CompileNotice(TrainerCallback):
    """Before the first step: what is being compiled; after it: how long that step took."""

    def __init__(self, regions) -> None:
        self.regions = regions
        self._start: float | None = None
        self.done = False

    def _compiled(self) -> int:
        return sum(region.compiled for region in self.regions.regions)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.done or self._start is not None or not state.is_world_process_zero or not self._compiled():
            return
        self._start = time.perf_counter()
        settings = self.regions.settings
        print(
            f"agrpo: compiling {self._compiled()} decoder layers ({settings.compile_backend}) during the first "
            "optimizer step: a few minutes on a GPU, once; later steps reuse the graphs (torch_compile=False "
            "turns this off)",
            file=sys.stderr,
            flush=True,
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is None or self.done:
            return
        self.done = True
        print(
            f"agrpo: first optimizer step, with compilation, took {time.perf_counter() - self._start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
