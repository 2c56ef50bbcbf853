"""`TreePlan`: everything one packed row's forward needs beyond the weights, built once, read by every layer.

Owns the bundle (tree layout, the attention backend and its per-forward state such as a block mask,
the Gated DeltaNet plan) and `build_tree_plan`, which makes it either for a tree-enabled model (the
model's settings decide backend, device and layer plans) or standalone for kernel tests and
benchmarks (attention only). Building does host-side index work and copies small index tensors to the
device; a trainer can build the next row's plan while the current one trains: with `non_blocking` the
copies go through pinned memory and are only queued on the current stream, so building never waits
for the GPU to finish the work already queued (backends' `prepare` then runs as queued device work).
Inside a torch.compile'd decoder layer `attend` runs the backend as its `under_compile` says: traced into
the graph, through the custom op of `_attention_op.py`, or behind a graph break. Does not know
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agrpo_packing import PackedRow

from ._attention_backend import AttentionBackend
from ._attention_needs import AttentionNeeds
from ._attention_op import tree_attention_op
from ._backends import resolve_backend
from ._deltanet_plan import DeltaNetPlan, build_deltanet_plan
from ._exceptions import UnsupportedModelError
from ._model_patch import tree_settings
from ._tree_layout import TreeLayout, build_tree_layout


@dataclass(kw_only=True, slots=True, frozen=True)
class TreePlan:
    """One packed row, laid out for a backend; pass to `token_logprobs(..., plan=...)` or call `attend`."""

    layout: TreeLayout
    """Index tensors of the row (see `TreeLayout`)."""
    backend: AttentionBackend
    """The attention backend the plan was prepared for."""
    attention_state: object
    """What `backend.prepare` returned (a BlockMask for flex, None for most)."""
    deltanet: DeltaNetPlan | None
    """Plan of the Gated DeltaNet layers; None for models without them."""
    deltanet_kernel: str | None
    """"torch" or "fla" for the Gated DeltaNet layers; None without them."""

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def attend(
        self,
        query,
        key,
        value,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ):
        """Tree attention of one layer: query (1, Hq, N, D), key/value (1, Hkv, N, D) -> (1, N, Hq, D). `window`: keep
        the last `window` tokens of each query's path (a sliding-window layer); `sinks` (Hq,): learned sink logits."""
        check_input_dtypes(self.backend, query, key, value)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        window = window or None
        compiling = torch.compiler.is_compiling()
        if compiling and self.backend.under_compile == "custom_op":
            return tree_attention_op(
                self.backend.name, query, key, value, self.layout, scaling=scaling, softcap=softcap, window=window,
                sinks=sinks,
            )  # fmt: skip
        attend = _behind_graph_break if compiling and self.backend.under_compile == "eager" else _attend
        state = self.attention_state
        return attend(self.backend, query, key, value, self.layout, state, scaling, softcap, window, sinks)


def _attend(backend, query, key, value, layout, state, scaling, softcap, window, sinks):
    return backend.attend(
        query, key, value, layout, state, scaling=scaling, softcap=softcap, window=window, sinks=sinks
    )


_behind_graph_break = torch.compiler.disable(_attend)
"""A backend dynamo cannot trace runs eagerly between two compiled graphs."""


def check_input_dtypes(backend: AttentionBackend, query, key, value) -> None:
    """Refuse, before the kernel does mid-forward, q/k/v of a dtype `backend` cannot run (float32 on a
    flash kernel: a float32 model forwarded without autocast)."""
    dtypes = {x.dtype for x in (query, key, value)}
    if backend.input_dtypes is None or dtypes <= set(backend.input_dtypes):
        return
    seen = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    runs = " and ".join(str(d).removeprefix("torch.") for d in backend.input_dtypes)
    raise UnsupportedModelError(
        f"backend={backend.name!r} runs {runs} only, but attention got {seen} query/key/value (float32 weights "
        "forwarded without autocast): run the forward under torch.autocast(device_type, dtype=torch.bfloat16) "
        "(q, k and v are cast to the autocast dtype), load the model in bfloat16, or "
        "enable_tree_attention(model, backend='adaptive') ('auto' on CUDA), 'flex' or 'cascade', which run float32"
    )


def _plan(
    row, backend, device, conv_kernel_size, deltanet_kernel, non_blocking=False, windows=(), sinks=False
) -> TreePlan:
    layout = build_tree_layout(row, device, non_blocking=non_blocking)
    deltanet = (
        None
        if conv_kernel_size is None
        else build_deltanet_plan(row, conv_kernel_size, device, non_blocking=non_blocking)
    )
    return TreePlan(
        layout=layout,
        backend=backend,
        attention_state=backend.prepare(layout, windows=windows, sinks=sinks),
        deltanet=deltanet,
        deltanet_kernel=deltanet_kernel,
    )


def build_tree_plan(
    packed_row: PackedRow,
    model: torch.nn.Module | None = None,
    *,
    backend: str = "auto",
    device: torch.device | str | None = None,
    non_blocking: bool = False,
    windows: tuple[int, ...] = (),
) -> TreePlan:
    """The plan of `packed_row` (host tensors). With `model` (after `enable_tree_attention(model)`), the
    model's backend, device and layers decide everything and `backend`/`device` must be left out. Without a
    model the plan covers attention only (for kernel tests and benchmarks): `backend` by name, `device`
    default CPU, `windows` the sliding windows to prepare. `non_blocking`: copy through pinned memory without
    waiting for the device's queued work (the plan is then only valid for work queued after it on the same
    stream)."""
    if model is None:
        device = torch.device("cpu" if device is None else device)
        backend_object = resolve_backend(backend, device, needs=AttentionNeeds(windows=tuple(windows)))
        return _plan(packed_row, backend_object, device, None, None, non_blocking, tuple(windows))
    if backend != "auto" or device is not None or windows:
        raise ValueError(
            "build_tree_plan(row, model) takes backend, device and windows from the model; "
            "choose them in enable_tree_attention(model, backend=...) and model.to(device)"
        )
    settings = tree_settings(model)
    return _plan(
        packed_row,
        settings.backend,
        settings.device,
        settings.conv_kernel_size,
        settings.deltanet_kernel,
        non_blocking,
        settings.needs.windows,
        settings.needs.sinks,
    )
