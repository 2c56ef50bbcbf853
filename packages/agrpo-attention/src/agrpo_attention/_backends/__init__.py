"""The table of tree-attention backends, and how "auto" picks one.

Owns `BACKENDS` (name -> backend object; add a backend by adding a module and one line here) and
`AUTO_ORDER`, the preference order per device type. On CUDA: FA3/FA4/aiter when installed (untested
here), then `adaptive` (varlen or flex per row, whichever the H200 measurements in docs/benchmarks.md
found faster for the row's sharing), then varlen, flex, cascade. "auto" also skips backends that cannot
run the model's parameter dtype: a float32 model may run without autocast, and flash varlen kernels
(varlen, FA3/FA4, aiter) refuse float32, so it gets `adaptive` (float32 rows through flex). A name given
explicitly is not refused for float32 weights, since autocast may cast q/k/v to bf16 at run time;
`TreePlan.attend` refuses a dtype the backend cannot run. Does not know transformers or models.
"""

from __future__ import annotations

import torch

from .._attention_backend import AttentionBackend
from .._attention_needs import NO_NEEDS, AttentionNeeds
from .._exceptions import BackendUnavailableError, UnsupportedModelError
from .adaptive import AdaptiveBackend
from .aiter import AiterBackend
from .cascade import CascadeBackend
from .fa3 import FA3Backend
from .fa4 import FA4Backend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .varlen import VarlenBackend

BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (
        ReferenceBackend(),
        FlexBackend(),
        VarlenBackend(),
        CascadeBackend(),
        AdaptiveBackend(),
        FA3Backend(),
        FA4Backend(),
        AiterBackend(),
    )
}

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("fa3", "fa4", "aiter", "adaptive", "varlen", "flex", "cascade", "reference"),
    "cpu": ("reference",),
}


def available_backends(device: torch.device | str, *, training: bool = True) -> list[str]:
    """Names of the backends that run on `device` here, in the table's order. `training=True` lists only
    those with a backward there (on CPU flex runs forward only); `training=False` adds forward-only ones."""
    device = torch.device(device)
    return [
        name
        for name, backend in BACKENDS.items()
        if backend.unavailable_reason(device) is None
        and not (training and device.type in backend.forward_only_on)
    ]


def runs_dtype(backend: AttentionBackend, dtype: torch.dtype | None) -> bool:
    """Whether `backend.attend` runs q/k/v of `dtype` (None: not known, so yes)."""
    return dtype is None or backend.input_dtypes is None or dtype in backend.input_dtypes


def resolve_backend(
    name: str,
    device: torch.device | str,
    *,
    needs: AttentionNeeds = NO_NEEDS,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend called `name` ("auto" picks the first available of `AUTO_ORDER` that runs `dtype`, the
    model's parameter dtype, and every window, sink and softcap the model `needs`), checked for `device`."""
    device = torch.device(device)
    if name == "auto":
        for candidate in AUTO_ORDER.get(device.type, ("reference",)):
            backend = BACKENDS[candidate]
            if (
                backend.unavailable_reason(device) is None
                and needs.unmet_by(backend) is None
                and runs_dtype(backend, dtype)
            ):
                return backend
        runs = f"runs {dtype} on {device}" if dtype is not None else f"runs on {device}"
        raise BackendUnavailableError(f"no tree-attention backend {runs}")
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"backend={name!r} is unknown; expected 'auto' or one of {sorted(BACKENDS)}"
        )
    backend = BACKENDS[name]
    if (unmet := needs.unmet_by(backend)) is not None:
        able = sorted(n for n, b in BACKENDS.items() if needs.unmet_by(b) is None)
        raise UnsupportedModelError(
            f"backend={name!r} cannot run this model: {unmet}, which {name!r} does not implement; "
            f"use one of {able}"
        )
    if (reason := backend.unavailable_reason(device)) is not None:
        raise BackendUnavailableError(f"backend={name!r} cannot run here: {reason}")
    return backend
