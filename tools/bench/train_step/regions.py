"""How the benchmark runs a model's decoder layers: transformers' own path or the trainer's `LayerRegions`.

Owns `LayerSetup` (compile on/off with backend and mode, checkpointing, the bf16 weight cast) and what
is measured about it: `apply` puts it on a model (`on`/`off` are transformers' gradient checkpointing
without regions, the eager step as it was before issue 20; `full`, `selective`, `none` and `auto` are
`LayerRegions` as the trainer installs them), `auto_hooks` drives `checkpointing="auto"`'s first-step
choice as the trainer's callback does, `parity` compares one setup's step loss and gradients against the
same regions run eagerly, `cast_seconds` times one bf16 cast of the layers' weights (what casting once per
step saves per forward and recompute), and `graph_counts` reads dynamo's counters (graphs, graph breaks).
Does not know timing or reporting.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, replace

import torch
from torch._dynamo.utils import counters

from agrpo_packing import PackedRow
from agrpo_trainer._device_row import prepare_device_row
from agrpo_trainer._layer_region import LayerRegions, RegionSettings
from agrpo_trainer._step import micro_batch_loss

from ..tree_attention.model_shapes import stock_checkpointing
from .compile_summary import FP32_PARITY, PARITY_SLACK

STOCK_MODES = ("on", "off")
"""transformers' gradient checkpointing on/off, layers as the model defines them (no regions)."""
REGION_MODES = ("full", "selective", "none", "auto")


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSetup:
    """One way of running the decoder layers."""

    checkpointing: str
    """`on`/`off` (transformers', no regions) or a `LayerRegions` mode: full, selective, none, auto."""
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    cast_weights: bool = True

    @property
    def label(self) -> str:
        if self.checkpointing in STOCK_MODES:
            return f"transformers checkpointing {self.checkpointing}, eager"
        compiled = f"compiled ({self.compile_backend})" if self.compile else "eager"
        return (
            f"regions {compiled}, checkpointing {self.checkpointing}, weights cast once {self.cast_weights}"
        )

    def settings(self) -> RegionSettings:
        return RegionSettings(
            compile=self.compile, compile_backend=self.compile_backend, compile_mode=self.compile_mode,
            checkpointing=self.checkpointing, cast_weights=self.cast_weights,
        )  # fmt: skip


def apply(model: torch.nn.Module, setup: LayerSetup, previous: LayerRegions | None) -> LayerRegions | None:
    """Put `setup` on `model`, replacing the previous setup's regions; the new regions, or None."""
    if setup.checkpointing not in STOCK_MODES + REGION_MODES:
        raise ValueError(
            f"--checkpointing {setup.checkpointing!r}; expected one of {STOCK_MODES + REGION_MODES}"
        )
    if previous is not None:
        previous.uninstall()
    if setup.checkpointing in STOCK_MODES:
        if setup.compile:
            raise ValueError("--compile on needs a regions mode (full, selective, none, auto), not on/off")
        stock_checkpointing(model, setup.checkpointing == "on")
        return None
    stock_checkpointing(model, False)
    return LayerRegions(setup.settings()).install(model)


class AutoHooks:
    """`checkpointing="auto"`: the trainer's `CheckpointingChoice` callback, called around one step."""

    def __init__(self, regions: LayerRegions | None, max_row_tokens: int) -> None:
        self.choice = regions.choice if regions is not None and regions.choice.pending else None
        if regions is not None:
            regions.max_row_tokens = max_row_tokens

    def begin(self) -> None:
        if self.choice is not None:
            self.choice.on_step_begin(None, None, None)

    def before_optimizer(self) -> None:
        if self.choice is not None:
            self.choice.on_pre_optimizer_step(None, None, None)

    def end(self) -> str | None:
        """The mode chosen (None when nothing was pending)."""
        if self.choice is None:
            return None
        self.choice.on_step_end(None, None, None)
        return self.choice.regions.mode


def _loss_and_grads(
    model, rows: list[PackedRow], settings, *, amp: bool
) -> tuple[float, dict[str, torch.Tensor]]:
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    tokens, total = sum(row.num_loss_terms for row in rows), 0.0
    for row in rows:
        prepared = prepare_device_row(row, model)
        with autocast:
            loss, _ = micro_batch_loss(
                model, prepared.row, settings, step_trained_tokens=tokens, world_size=1,
                micro_batches_per_step=len(rows), plan=prepared.plan,
            )  # fmt: skip
        loss.backward()
        total += float(loss.detach())
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


@contextlib.contextmanager
def _fp32_matmuls():
    """Full fp32 matmuls (no TF32) for the reference step, restored afterwards. Through the per-backend API
    (`fp32_precision`): the Trainer sets TF32 through it, after which torch refuses the legacy getter."""
    backends = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
    before = [b.fp32_precision for b in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, value in zip(backends, before, strict=True):
            backend.fp32_precision = value


@contextlib.contextmanager
def unwrapped_forward(model):
    """`model`'s own forward while inside: a model a Trainer prepared under bf16/fp16 has accelerate's autocast
    wrapper as its instance `forward` (the class forward kept as `_original_forward`), which would run the fp32
    reference's layers in bf16 (issue 38). Yields whether a wrapper was bypassed."""
    wrapped = vars(model).get("forward")
    if wrapped is None or not hasattr(model, "_original_forward"):
        yield False
        return
    model.forward = model._original_forward
    try:
        yield True
    finally:
        model.forward = wrapped


_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer(grads: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    return {n: g for n, g in grads.items() if (m := _LAYER.search(n)) and int(m.group(1)) == index}


def _grad_distance(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """How far `grads` are from `reference`: relative L2 distance over all parameters, the worst parameter's
    (and its name), cosine, and the norm ratio (a scale error shows as a ratio off 1 at a cosine near 1)."""
    names = list(reference)
    g = [grads[n].float() for n in names]
    r = [reference[n].float() for n in names]
    diff = torch.stack([(a - b).norm() for a, b in zip(g, r, strict=True)])
    norms = torch.stack([b.norm() for b in r])
    own = float(torch.stack([a.norm() for a in g]).norm())
    dot = sum(float((a * b).sum()) for a, b in zip(g, r, strict=True))
    per_param = diff / norms.clamp_min(1e-12)
    worst = int(per_param.argmax())
    return {
        "rel": float(diff.norm() / norms.norm()), "worst": float(per_param[worst]), "worst_name": names[worst],
        "cosine": dot / max(own * float(norms.norm()), 1e-30), "norm_ratio": own / max(float(norms.norm()), 1e-30),
    }  # fmt: skip


def parity(
    model, rows: list[PackedRow], setup: LayerSetup, regions: LayerRegions, step_settings, *, amp: bool
) -> dict:
    """This setup's step (loss and gradients over `rows`, one backward each, before any optimizer step) against
    the same regions run eagerly, and, under amp, both against an fp32 eager reference without autocast or TF32.

    Compiled against eager alone cannot judge compilation under amp: a GRPO gradient is a difference of large
    per-sample terms (centered advantages), so bf16 rounding, or the order of atomic adds in one kernel, moves it
    by tens of percent between two eager runs. What compilation must not do is take the step further from the
    exact gradient than eager bf16 does: `grad_err_ratio` (compiled's distance to fp32 over eager's) near 1,
    `passed` when it is at most `PARITY_SLACK`. In fp32 runs the eager regions are the reference (`FP32_PARITY`).
    The fp32 pass bypasses accelerate's autocast wrapper on a Trainer's model (`unwrapped_forward`): through it
    the reference's layers ran in bf16 like eager's, which halved eager's distance and failed compiled
    (`trainer_run.py`, issue 38)."""
    loss_c, grads_c = _loss_and_grads(model, rows, step_settings, amp=amp)
    regions.uninstall()
    eager = LayerRegions(replace(setup, compile=False, checkpointing=regions.mode).settings()).install(model)
    loss_e, grads_e = _loss_and_grads(model, rows, step_settings, amp=amp)
    if amp:  # a true fp32 step: no autocast, not even accelerate's around the forward of a Trainer's model
        with _fp32_matmuls(), unwrapped_forward(model):
            loss_r, grads_r = _loss_and_grads(model, rows, step_settings, amp=False)
    eager.uninstall()
    regions.install(model)
    d = _grad_distance(grads_c, grads_e)
    out = {
        "loss": loss_c, "loss_eager": loss_e, "loss_rel_diff": abs(loss_c - loss_e) / max(abs(loss_e), 1e-12),
        "grad_rel_diff": d["rel"], "grad_rel_diff_worst_param": d["worst"], "grad_worst_param": d["worst_name"],
        "grad_cosine": d["cosine"], "grad_norm_ratio": d["norm_ratio"],
    }  # fmt: skip
    if not amp:
        out["passed"] = d["rel"] <= FP32_PARITY
        return out
    c, e = _grad_distance(grads_c, grads_r), _grad_distance(grads_e, grads_r)
    layers = sorted({int(m.group(1)) for m in map(_LAYER.search, grads_r) if m})
    out["grad_err_by_layer"] = {  # where the error starts: per decoder layer, compiled's and eager's
        index: (_grad_distance(_layer(grads_c, index), _layer(grads_r, index))["rel"],
                _grad_distance(_layer(grads_e, index), _layer(grads_r, index))["rel"])
        for index in layers
    }  # fmt: skip
    ratio = c["rel"] / max(e["rel"], 1e-12)
    out.update(
        loss_fp32=loss_r, grad_err_compiled=c["rel"], grad_err_eager=e["rel"], grad_cosine_compiled_fp32=c["cosine"],
        grad_cosine_eager_fp32=e["cosine"], grad_norm_ratio_compiled_fp32=c["norm_ratio"],
        grad_norm_ratio_eager_fp32=e["norm_ratio"], grad_worst_param_fp32=c["worst_name"], grad_err_ratio=ratio,
        passed=ratio <= PARITY_SLACK,
    )  # fmt: skip
    return out


def cast_seconds(model: torch.nn.Module, repeats: int = 5) -> dict:
    """One bf16 cast of every matmul weight of the decoder layers (what autocast does per forward and per
    recompute, and `WeightCast` once per step): median seconds, weights and bytes cast."""
    from agrpo_trainer._layer_region import decoder_layers
    from agrpo_trainer._weight_cast import castable_names

    weights = [layer.get_parameter(n) for layer in decoder_layers(model) for n in castable_names(layer)]
    weights = [w for w in weights if w.dtype != torch.bfloat16]
    if not weights:
        return {"weights": 0, "seconds": 0.0, "gib": 0.0}
    cuda = weights[0].is_cuda
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            copies = [w.to(torch.bfloat16) for w in weights]
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del copies
    gib = sum(w.numel() for w in weights) * 6 / 2**30  # fp32 read, bf16 written
    return {"weights": len(weights), "seconds": sorted(times[1:])[repeats // 2], "gib": gib}


def graph_counts() -> dict:
    """Graphs dynamo has compiled and graph breaks it has hit in this process so far."""
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
