"""`WeightCast`: the low-precision copy of each decoder layer's matmul weights, made once per optimizer step.

Under autocast with fp32 master weights every `F.linear` casts its weight to bf16, on every forward of
every micro-batch and again in every checkpoint recompute (a compiled layer casts inside its graph each
call); with 28 layers, 7 rows per step and checkpointing that is 14 casts of every weight per step, each
one a small kernel. FSDP2's mixed-precision policy instead keeps one bf16 copy per step. This does the
same without FSDP: `weights(layer, dtype)` returns `{name: p.to(dtype)}` for the `nn.Linear` weights and
biases of a layer, cast the first time they are asked for and reused until the master tensor changes
(its version counter moves when the optimizer updates it in place; a new tensor assigned to the
parameter changes its storage). The copy is a differentiable `p.to(dtype)`, exactly the cast autocast
makes, so each micro-batch's backward flows through it into the fp32 `p.grad` as under autocast and
losses and gradients are bit-identical to the per-forward cast (tests). Copies made without gradient
recording (a `no_grad` forward) are never cached, so they cannot stand in for a training forward.
Cost: one bf16 copy of the layers' matmul weights stays allocated (2 bytes per parameter; 2.8 GB for a
1.7B model). Only eager layers take the copies (`LayerRegion` decides): handed them, compiled regions'
gradients drifted from an fp32 step on the H200, while casting in their own graph costs them nothing.
Does not know compile, checkpointing or the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Copy:
    """One cached cast: the copy and the state of its master when it was made."""

    tensor: torch.Tensor
    version: int
    data_ptr: int


def _is_stale(copy: _Copy | None, master: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        copy is None
        or copy.tensor.dtype != dtype
        or copy.version != master._version
        or copy.data_ptr != master.data_ptr()
        or copy.tensor.requires_grad != master.requires_grad
    )


def castable_names(layer: torch.nn.Module) -> list[str]:
    """Names (relative to `layer`) of the floating-point `nn.Linear` weights and biases autocast would cast;
    none when a parameter is a sharded DTensor (FSDP2 casts those itself)."""
    names = []
    for module_name, module in layer.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if hasattr(param, "to_local"):
                return []
            if param.is_floating_point():
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


class WeightCast:
    """The step's low-precision copies of the castable weights of a model's decoder layers."""

    def __init__(self) -> None:
        self._copies: dict[int, _Copy] = {}
        self.casts = 0
        """Weights cast so far (a test and benchmark probe: per step it should be one per weight)."""

    def weights(
        self, layer: torch.nn.Module, names: list[str], dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """`{name: weight in dtype}` for `names` of `layer`, cast now or reused from earlier this step."""
        out = {}
        for name in names:
            master = layer.get_parameter(name)
            if master.dtype == dtype:
                out[name] = master
                continue
            copy = self._copies.get(id(master))
            if _is_stale(copy, master, dtype):
                tensor = master.to(dtype)
                self.casts += 1
                if not torch.is_grad_enabled() and master.requires_grad:
                    out[name] = tensor  # no gradient link: never reused by a training forward
                    continue
                copy = _Copy(tensor=tensor, version=master._version, data_ptr=master.data_ptr())
                self._copies[id(master)] = copy
            out[name] = copy.tensor
        return out

    def clear(self) -> None:
        """Drop every copy (their memory goes back to the allocator)."""
        self._copies.clear()
