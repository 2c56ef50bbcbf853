"""The adaptive backend: per row, the faster of `varlen` and `flex` as measured on the H200 (docs/benchmarks.md).

Owns the choice rule. Gathering path K/V (`varlen`) wins while rows share little: at packing ratios 1
and 2 it was 3-7% faster than flex and within 2% of plain packing at ratio 1; FlexAttention's block
mask wins as sharing grows (ratio 3.4: 3%, ratio 8: 17% faster per step), since it never copies a shared
prompt. The rule reads one number of the layout, K/V path tokens per packed token (P / N, about the
packing ratio): `flex` from `FLEX_FROM_PATH_RATIO` on, `varlen` below. The choice is made once per row,
in `prepare`, so every layer of a forward runs the same kernel. One exception, by dtype, which `prepare`
cannot know (autocast is decided at forward time): q/k/v that varlen's flash kernel refuses (float32: a
float32 model without autocast) run through flex, which matched the per-sample truth in float32 on the
H200; its block mask is then built once per forward, on the first layer. So `adaptive` runs any floating
dtype and is what `auto` picks on CUDA for float32 models too. Sliding windows run on either kernel; a model
with attention sinks (which varlen cannot take) runs every row through flex. Does not know the kernels
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._tree_layout import TreeLayout
from .flex import FlexBackend
from .varlen import VarlenBackend

FLEX_FROM_PATH_RATIO = 2.5
"""P / N at and above which flex is chosen (measured crossover between ratios 2 and 3.4)."""


def path_ratio(layout: TreeLayout) -> float:
    """K/V path tokens per packed token: 1 for plain rows, about the packing ratio for GRPO rows."""
    return layout.kv_offsets_host[-1] / max(1, layout.num_tokens)


@dataclass(slots=True)
class AdaptiveState:
    """The row's choice and its state, plus flex's block mask once a layer needed it (float32 inputs)."""

    backend: VarlenBackend | FlexBackend
    """The backend `choose` picked for the row."""
    inner: object
    """What that backend's `prepare` returned."""
    windows: tuple[int, ...] = ()
    """The model's sliding windows (flex builds a block mask per window when it takes over a varlen row)."""
    flex_mask: object = None
    """flex's block mask of the row, built on first need when `backend` is varlen; None until then."""


class AdaptiveBackend:
    """varlen for rows that share little, flex for rows that share a lot or run in float32 (CUDA only)."""

    name = "adaptive"
    supports_softcap = False
    supports_window = True
    supports_sinks = True
    input_dtypes = None
    forward_only_on = FlexBackend.forward_only_on
    under_compile = "trace"  # the row's choice is a guarded object: one graph per chosen backend

    def __init__(self) -> None:
        self._varlen, self._flex = VarlenBackend(), FlexBackend()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self._varlen.unavailable_reason(device) or self._flex.unavailable_reason(device)

    def choose(self, layout: TreeLayout):
        """The backend this row runs with."""
        return self._flex if path_ratio(layout) >= FLEX_FROM_PATH_RATIO else self._varlen

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> AdaptiveState:
        backend = self._flex if sinks else self.choose(layout)
        return AdaptiveState(backend=backend, inner=backend.prepare(layout, windows=windows), windows=windows)

    def attend(
        self,
        query,
        key,
        value,
        layout: TreeLayout,
        state: AdaptiveState,
        *,
        scaling,
        softcap,
        window=None,
        sinks=None,
    ):
        backend, inner = state.backend, state.inner
        half_only = self._varlen.input_dtypes or ()
        if backend is self._varlen and (
            sinks is not None or any(x.dtype not in half_only for x in (query, key, value))
        ):
            if state.flex_mask is None:
                state.flex_mask = self._flex.prepare(layout, windows=state.windows)
            backend, inner = self._flex, state.flex_mask
        return backend.attend(
            query, key, value, layout, inner, scaling=scaling, softcap=softcap, window=window, sinks=sinks
        )
