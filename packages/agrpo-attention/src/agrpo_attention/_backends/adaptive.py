"""The adaptive backend: per row, the faster of `varlen` and `flex` as measured on the H200 (docs/benchmarks.md).

Owns the choice rule. Gathering path K/V (`varlen`) wins while rows share little: at packing ratios 1
and 2 it was 3-7% faster than flex and within 2% of plain packing at ratio 1; FlexAttention's block
mask wins as sharing grows (ratio 3.4: 3%, ratio 8: 17% faster per step), since it never copies a shared
prompt. The rule reads one number of the layout, K/V path tokens per packed token (P / N, about the
packing ratio): `flex` from `FLEX_FROM_PATH_RATIO` on, `varlen` below. The choice is made once per row,
in `prepare`, so every layer of a forward runs the same kernel. Does not know the kernels themselves.
"""

from __future__ import annotations

import torch

from .._tree_layout import TreeLayout
from .flex import FlexBackend
from .varlen import VarlenBackend

FLEX_FROM_PATH_RATIO = 2.5
"""P / N at and above which flex is chosen (measured crossover between ratios 2 and 3.4)."""


def path_ratio(layout: TreeLayout) -> float:
    """K/V path tokens per packed token: 1 for plain rows, about the packing ratio for GRPO rows."""
    return layout.kv_offsets_host[-1] / max(1, layout.num_tokens)


class AdaptiveBackend:
    """varlen for rows that share little, flex for rows that share a lot (CUDA only)."""

    name = "adaptive"
    supports_softcap = False

    def __init__(self) -> None:
        self._varlen, self._flex = VarlenBackend(), FlexBackend()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return self._varlen.unavailable_reason(device) or self._flex.unavailable_reason(device)

    def choose(self, layout: TreeLayout):
        """The backend this row runs with."""
        return self._flex if path_ratio(layout) >= FLEX_FROM_PATH_RATIO else self._varlen

    def prepare(self, layout: TreeLayout) -> object:
        backend = self.choose(layout)
        return backend, backend.prepare(layout)

    def attend(self, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
        backend, inner = state
        return backend.attend(query, key, value, layout, inner, scaling=scaling, softcap=softcap)
