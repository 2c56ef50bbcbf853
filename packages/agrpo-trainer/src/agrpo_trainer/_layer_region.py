"""`LayerRegions`: each decoder layer's forward as one region the trainer compiles, checkpoints and casts.

Owns what happens around a decoder layer of the policy, applied from outside the model as torchtitan
applies compile and activation checkpointing (the model's code is unchanged; parameter names and the
state dict too). `install` replaces each layer's `forward` on the instance with a `LayerRegion`, which
on a training forward (1) takes the layer's bf16 matmul weights from `WeightCast` (cast once per
optimizer step) when autocast runs over fp32 weights and the layer runs eagerly, (2) runs the layer through `torch.func.
functional_call` with those weights, checkpointed as the current mode says (`_activation_checkpointing`),
and (3) with `compile` does all of that inside one `torch.compile`d function per mode, shared by every
layer (regional compilation: the first layer's compile serves the others; backend and mode from
`torch_compile_backend` / `torch_compile_mode`). Checkpointing inside the compiled region lets the
partitioner recompute within the fused backward instead of replaying the forward eagerly (torchtitan
also wraps each block in its checkpoint first and compiles the wrapped block). Tree attention runs inside
the graph (`TreePlan.attend`: traced backends such as varlen and flex, or the reference's custom op).
Row sizes vary every step: the region compiles with dynamic shapes from the start and only the weights
marked static, so one graph per mode and kind of row serves every row (kinds: rows that share nothing
or something, and the kernel `adaptive` picks; 2-3 graphs per mode, counted in tests and the benchmark).
Gated DeltaNet layers compile like dense ones when their tree forward is custom ops only
(agrpo-attention's `deltanet_traceable`: deltanet_kernel "triton", the whole tree in one
`agrpo::delta_rule_forward` and the convolution in `agrpo::path_conv_forward`, fake and autograd registered: one
graph, no break, tested on CPU through Triton's interpreter). Layers left eager, per layer: those holding a Gated
DeltaNet mixer on the "torch" or "fla" kernel (their tree scan loops over the row's levels on the host and would
compile once per tree shape), and MoE layers while the router loss records router logits (transformers' output-capturing hooks read a ContextVar, a graph break inside the
checkpoint; without the router loss a Qwen3-MoE layer compiles into one graph, tested). Forwards without
gradients (the parity probe) run the layer as it was. transformers' own gradient checkpointing is
switched off on the layers (this replaces it). Does not know the loss, the optimizer or rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from agrpo_attention import deltanet_traceable

from ._activation_checkpointing import (
    CHECKPOINT_MODES,
    mlp_weight_shapes,
    run_checkpointed,
    selective_context_fn,
)
from ._checkpointing_choice import CheckpointingChoice, LayerProbe
from ._compile_notice import CompileNotice
from ._weight_cast import WeightCast, castable_names

logger = logging.getLogger("agrpo_trainer")

_EAGER_MIXERS = ("GatedDeltaNet",)
"""Module class-name endings that keep their layer eager unless their tree forward traces (module docstring)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionSettings:
    """How the trainer runs the decoder layers."""

    compile: bool
    """torch.compile each decoder layer's region."""
    compile_backend: str = "inductor"
    """`torch.compile(backend=...)`."""
    compile_mode: str | None = None
    """`torch.compile(mode=...)`."""
    checkpointing: str = "auto"
    """"auto", "full", "selective" or "none"."""
    cast_weights: bool = True
    """Under autocast over fp32 weights, cast the eager layers' matmul weights once per optimizer step. Compiled
    layers cast inside their graph: handed the cast copies, a compiled region's gradients were 2x as far from an
    fp32 step as eager bf16's on the H200 (4 layers; 3.8x over 28, norm off by a quarter), with inductor and
    aot_eager alike, while casting in the graph matched eager and ran as fast (docs/benchmarks.md)."""


class _LayerCall(torch.nn.Module):
    """The layer's own class forward, for `functional_call` (the instance's region override bypassed)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        return type(self.layer).forward(self.layer, hidden_states, *args, **kwargs)


def _body(runner: _LayerCall, weights: dict, hidden_states, *args, **kwargs):
    if not weights:
        return runner(hidden_states, *args, **kwargs)
    return torch.func.functional_call(runner, weights, (hidden_states, *args), kwargs)


def _region_full(runner, weights, context_fn, hidden_states, *args, **kwargs):
    return run_checkpointed("full", _body, runner, weights, hidden_states, *args, **kwargs)


def _region_selective(runner, weights, context_fn, hidden_states, *args, **kwargs):
    return run_checkpointed(
        "selective", _body, runner, weights, hidden_states, *args, context_fn=context_fn, **kwargs
    )


def _region_none(runner, weights, context_fn, hidden_states, *args, **kwargs):
    return _body(runner, weights, hidden_states, *args, **kwargs)


_REGIONS = {"full": _region_full, "selective": _region_selective, "none": _region_none}
"""One function per mode, so each mode's graphs live in their own compile cache."""
_COMPILED: dict[tuple, object] = {}


def compiled_region(mode: str, backend: str, compile_mode: str | None):
    """The compiled region function of `mode`, shared by every layer and model of the process. Dynamic
    shapes from the first compile (`dynamic=True`): every row-sized dimension and integer (tokens,
    segments, path length, the longest segment and path a varlen kernel is told) is symbolic, so a row
    of any size reuses the graph; the parameters (and their cast copies, marked static) keep fixed shapes.
    Not `fullgraph`: a backend that cannot be traced runs behind a graph break (`under_compile="eager"`)."""
    key = (mode, backend, compile_mode)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_REGIONS[mode], backend=backend, mode=compile_mode, dynamic=True)
    return _COMPILED[key]


class LayerRegion:
    """One decoder layer's `forward` (set on the instance by `LayerRegions.install`)."""

    def __init__(self, layer: torch.nn.Module, index: int, regions: LayerRegions, compiled: bool) -> None:
        self.runner, self.index, self.regions, self.compiled = _LayerCall(layer), index, regions, compiled
        self.names = castable_names(layer)
        self.context_fn = selective_context_fn(mlp_weight_shapes(layer))

    def _weights(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self.compiled or not (
            self.regions.settings.cast_weights and self.names and torch.is_autocast_enabled(device.type)
        ):
            return {}
        dtype = torch.get_autocast_dtype(device.type)
        cast = self.regions.cast.weights(self.runner.layer, self.names, dtype)
        return {f"layer.{name}": weight for name, weight in cast.items()}

    def _region(self, mode: str, weights: dict):
        if not self.compiled:
            return _REGIONS[mode]
        for weight in weights.values():  # every size is dynamic but the weights'
            torch._dynamo.mark_static(weight)
        settings = self.regions.settings
        return compiled_region(mode, settings.compile_backend, settings.compile_mode)

    def __call__(self, hidden_states, *args, **kwargs):
        if not (self.runner.layer.training and torch.is_grad_enabled()):
            return self.runner(hidden_states, *args, **kwargs)
        regions = self.regions
        probed = regions.probe.mode_for(self.index)
        mode = probed or regions.mode_of(self.index)
        weights = self._weights(hidden_states.device)
        regions.largest_row = max(regions.largest_row, hidden_states.shape[1])
        start = regions.probe.before(hidden_states.device) if probed else None
        out = self._region(mode, weights)(
            self.runner, weights, self.context_fn, hidden_states, *args, **kwargs
        )
        if probed:
            regions.probe.after(
                probed, start, out[0] if isinstance(out, tuple) else out, hidden_states.shape[1]
            )
        return out


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's trained repeated blocks: transformers `GradientCheckpointingLayer`s with a parameter that
    requires grad (frozen vision towers left out), outermost only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: list[torch.nn.Module] = []
    for _, module in model.named_modules():
        if not isinstance(module, GradientCheckpointingLayer) or any(_contains(f, module) for f in found):
            continue
        if any(p.requires_grad for p in module.parameters()):
            found.append(module)
    return found


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def eager_reason(layer: torch.nn.Module, *, router_logits: bool, deltanet_traced: bool = False) -> str | None:
    """Why `layer` stays eager under compile (see the module docstring), or None when it compiles.
    `deltanet_traced`: the model's Gated DeltaNet tree forward traces whole (`deltanet_traceable`)."""
    if not deltanet_traced and any(type(m).__name__.endswith(_EAGER_MIXERS) for m in layer.modules()):
        return "Gated DeltaNet (deltanet_kernel torch/fla)"
    if router_logits and any(hasattr(m, "experts") and hasattr(m, "gate") for m in layer.modules()):
        return "MoE with router logits recorded"
    return None


class LayerRegions:
    """The regions of one model's decoder layers, the checkpointing mode they run and its first-step probe."""

    def __init__(self, settings: RegionSettings) -> None:
        self.settings = settings
        self.mode = "full" if settings.checkpointing == "auto" else settings.checkpointing
        """The checkpointing mode the layers run now (with `layer_modes`, the one that recomputes most)."""
        self.layer_modes: tuple[str, ...] | None = None
        """Each layer's mode where `auto` mixed them; None: every layer runs `mode`."""
        self.cast = WeightCast()
        self.probe = LayerProbe()
        self.regions: list[LayerRegion] = []
        self.device: torch.device | None = None
        self.largest_row = 0
        """Most tokens of a row the layers saw (for the auto choice)."""
        self.max_row_tokens: int | None = None
        """The token budget of a row when the config sets one; None (the server's context length, or a fixed
        sample count): 1.25x the first step's largest row."""
        self.choice = CheckpointingChoice(self)
        """The trainer callback that makes `checkpointing="auto"`'s choice after the first step."""

    @classmethod
    def for_trainer(cls, trainer) -> LayerRegions:
        """The regions a trainer's config asks for (`region_settings`), with `choice` added to its callbacks;
        accelerate is told not to compile the whole model in `prepare` (the Trainer hands it `torch_compile*`):
        the layers are compiled instead, and the first step's compile is announced (`CompileNotice`). A positive
        `token_budget` bounds the rows `auto` plans for."""
        keep_whole_model_eager(trainer.accelerator)
        regions = cls(region_settings(trainer.args))
        budget = trainer.args.token_budget
        regions.max_row_tokens = budget if budget is not None and budget > 0 else None
        trainer.add_callback(regions.choice)
        trainer.add_callback(CompileNotice(regions))
        return regions

    @property
    def num_layers(self) -> int:
        return len(self.regions)

    def install(self, model: torch.nn.Module, *, router_logits: bool = False) -> LayerRegions:
        """Put a region on every decoder layer of `model` (on its training device already); again on the
        same model replaces the regions. `router_logits`: the step records MoE router logits (router loss)."""
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpointing {self.mode!r}; expected 'auto' or one of {list(CHECKPOINT_MODES)}"
            )
        layers = decoder_layers(model)
        self.device = next(model.parameters()).device
        self.regions, eager = [], {}
        traced = deltanet_traceable(model)
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = False  # this region checkpoints instead of transformers
            reason = (
                eager_reason(layer, router_logits=router_logits, deltanet_traced=traced)
                if self.settings.compile
                else None
            )
            if reason is not None:
                eager[reason] = eager.get(reason, 0) + 1
            layer.forward = LayerRegion(layer, index, self, compiled=self.settings.compile and reason is None)
            self.regions.append(layer.forward)
        compiled = sum(r.compiled for r in self.regions)
        logger.info(
            "decoder layers: %d, compiled %d (%s), eager %s; checkpointing %s; bf16 weights cast once per step: %s",
            len(layers), compiled, self.settings.compile_backend if self.settings.compile else "-",
            ", ".join(f"{n} ({why})" for why, n in eager.items()) or len(layers) - compiled,
            self.settings.checkpointing, self.settings.cast_weights,
        )  # fmt: skip
        return self

    def uninstall(self) -> None:
        """Give every layer its class's forward back (benchmarks compare against the stock path)."""
        for region in self.regions:
            del region.runner.layer.forward
        self.regions = []

    def set_mode(self, mode: str) -> None:
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpointing mode {mode!r}; expected one of {list(CHECKPOINT_MODES)}")
        self.mode, self.layer_modes = mode, None

    def set_layer_modes(self, modes: tuple[str, ...]) -> None:
        """One mode per layer (the `auto` choice); a single mode when they are all the same."""
        if len(set(modes)) <= 1:
            self.set_mode(modes[0] if modes else "full")
            return
        self.set_mode(min(modes, key=CHECKPOINT_MODES.index))  # CHECKPOINT_MODES: most recompute first
        self.layer_modes = tuple(modes)

    def mode_of(self, index: int) -> str:
        """The mode layer `index` runs now."""
        modes = self.layer_modes
        return modes[index] if modes is not None and index < len(modes) else self.mode


COMPILE_BY_DEFAULT = False
"""Off: the trainer's own `train()` compiled on one H100 (2026-12-05, `tools/bench/train_step/trainer_run.py` over
recorded CPU-server rollouts, 1.7B shape, auto -> none) put the step's gradients 3.77x as far from an fp32 step as
eager bf16's (2.87e-1 vs 7.62e-2, cosine 0.959, even from layer 0 on) and its loss 10x as far (7.6e-3 vs 7.7e-4),
and compiled one new graph over 20 steps of fresh rows; the bench's own step on its synthetic 16k rows passes the
same check (docs/benchmarks.md). That check's fp32 reference ran through accelerate's autocast wrapper, so its
layers were bf16 (issue 38: on CPU 1.86 as measured, 0.93 against a true fp32 step; on one H100 on 2026-12-07 step T
passed parity against a true fp32 step, ratio 1.02 full fine-tuning and 0.82 LoRA, no graph break). Still off: that
run's full fine-tuning compiled one new graph at step 18, its first row of exactly the token budget, for a reason not
yet named (`TORCH_LOGS=recompiles` on a GPU names it). Turn on when step T passes whole."""


def default_torch_compile(*, use_cpu: bool, fsdp: bool, named: bool) -> bool:
    """`torch_compile=None` resolves to this: per-layer compilation wherever a compile backend or mode is
    named, and on CUDA once `COMPILE_BY_DEFAULT` is on; not by default under FSDP (regional compilation of FSDP2-sharded
    layers is not measured: said once, see `fsdp_compile_notice`) or on CPU, where compiling costs more than it
    saves for tiny models."""
    return named or (COMPILE_BY_DEFAULT and torch.cuda.is_available() and not use_cpu and not fsdp)


def fsdp_compile_notice(*, use_cpu: bool, fsdp: bool, named: bool) -> None:
    """Say why a CUDA run under FSDP trains eager when `torch_compile` was left to its default."""
    if fsdp and not named and not use_cpu and COMPILE_BY_DEFAULT and torch.cuda.is_available():
        logger.warning(
            "torch_compile=None stays off under FSDP: compiled decoder layers of FSDP2-sharded models are not "
            "measured yet (docs/benchmarks.md); set torch_compile=True to try them"
        )


def checkpointing_on(args) -> bool:
    """Whether the config asks for activation checkpointing, under either transformers name."""
    return bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)


def check_checkpointing_mode(mode: str, checkpointing: bool) -> None:
    """`checkpointing_mode` is one the regions run; a mode other than auto without checkpointing is warned about."""
    if mode not in ("auto", "full", "selective"):
        raise ValueError(f"checkpointing_mode={mode!r}; expected 'auto', 'full' or 'selective'")
    if not checkpointing and mode != "auto":
        logger.warning("checkpointing_mode=%r has no effect: gradient_checkpointing is False", mode)


def region_settings(args) -> RegionSettings:
    """The regions' settings from a trainer config: compile from `torch_compile*`, the checkpointing mode
    (`none` without gradient checkpointing), weights cast once under bf16/fp16 autocast."""
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
    if kwargs and checkpointing_on(args):
        logger.warning(
            "gradient_checkpointing_kwargs=%s is not used: agrpo checkpoints each decoder layer itself "
            "(non-reentrant; checkpointing_mode picks what is kept)", kwargs,
        )  # fmt: skip
    return RegionSettings(
        compile=bool(args.torch_compile),
        compile_backend=args.torch_compile_backend or "inductor",
        compile_mode=args.torch_compile_mode,
        checkpointing=args.checkpointing_mode if checkpointing_on(args) else "none",
    )


def keep_whole_model_eager(accelerator) -> None:
    """Stop accelerate from `torch.compile`-ing the whole model in `prepare` (the Trainer hands it the
    `torch_compile*` settings): the trainer compiles per decoder layer instead (`LayerRegions`)."""
    from accelerate.utils import DynamoBackend

    accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
