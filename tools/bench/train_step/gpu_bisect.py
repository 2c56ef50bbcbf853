"""Issue 38: which difference between the passing bench and the trainer's own compiled `train()` moves the gradient.

Each variant is the failing configuration of `trainer_run.py` (bf16 autocast over fp32 weights through
accelerate's wrapper, checkpointing `auto`, attention `auto`, dynamic shapes, `WeightCast`, full fine-tuning,
4,096-token rows of the recorded CPU-server rollouts) with one thing changed. Per variant, two measurements,
both with the bench's rule (`regions.parity`: compiled passes when its gradient is at most `PARITY_SLACK` times
as far from fp32 as eager bf16's):

* **step 1 of `train()` itself** (`step1`): three `ReplayTrainer`s from the same initial weights over the same
  recorded samples, compiled amp, eager amp and fp32 (no autocast, no TF32), each training its first optimizer
  step; the gradients are taken just before clipping (the Trainer's `clip_grad_norm_` call), the loss is the
  sum of the step's `compute_loss` values. Nothing here is a bench copy of the step: wrapper, head, loss scaling,
  WeightCast, checkpointing, compile are the trainer's. The rows each trained are compared (`same_rows`).
* **`trainer_run.py`'s own check after training** (`post`): on the compiled trainer's model after `--steps`
  steps, the trainer's compiled regions, eager regions and an fp32 pass, over `trainer_run`'s two rows; the fp32
  pass once as `trainer_run` runs it (the model's `forward` still wrapped by accelerate's autocast, so its layers
  run in bf16) and once with the wrapper bypassed (`model._original_forward`, a true fp32 reference).

Printed per variant: the ratio, loss gaps and per-layer gradient errors (compiled / eager distance to fp32); JSON
is rewritten after every variant (`--json`, default `$OUT/gpu_bisect.json`), so a time-limit cut keeps the rest.

GPU (one H100/H200, torch 2.11, no uv): `source tools/bench/train_step/gpu_env.sh; python3 -m
tools.bench.train_step.gpu_bisect --layers 8`. CPU: `--device cpu --model cpu-mid` (inductor emits C++; flex has
no CPU backward, so the attention variants are skipped there); `--tiny` is a smoke test of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import tempfile
import time
import types
from dataclasses import asdict, dataclass, replace

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

import agrpo_trainer._layer_region as layer_region
from agrpo_attention import enable_tree_attention
from agrpo_attention.testing import build_tokenizer
from agrpo_packing import PackSample
from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer.testing import ReplayTrainer

from ..tree_attention.model_shapes import SHAPES, build_random_model
from .gpu_bisect_report import _compare, _loss_gaps, _row_key, dump, post_parity, print_variant
from .regions import _fp32_matmuls, graph_counts
from .rollouts import ROLLOUTS, load
from .step import plan_rows
from .trainer_run import rescored

SHAPES.setdefault(
    "cpu-mid",
    dict(kind="dense", hidden=1024, mlp=3072, layers=4, heads=8, kv_heads=4, head_dim=128, vocab=4096),
)
"""A CPU-sized dense shape: 1.7B's head width and GQA ratio, fewer heads, a small vocabulary."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """One configuration of the trainer's compiled step (the defaults: the run that failed on the H100)."""

    name: str = "base"
    budget: int = 4096
    checkpointing: str = "auto"
    """auto, full, selective (gradient checkpointing on), or none (off)."""
    wrapper: bool = True
    """accelerate's autocast wrapper around the model's forward (the Trainer's amp); off: autocast around the
    whole `compute_loss` instead (as the bench: layers, head and loss), accelerate's `native_amp` off."""
    backend: str = "auto"
    dynamic: bool = True
    """The regions' `torch.compile(dynamic=True)`; off: `dynamic=False` (one graph per row size)."""
    cast_weights: bool = True
    lora: bool = False
    tf32: bool = True
    """TF32 matmuls as `torch_compile=True` turns them on in TrainingArguments (the head's fp32 matmul and any
    fp32 matmul outside autocast); CUDA only."""

    def eager_key(self) -> tuple:
        return (
            self.budget,
            self.checkpointing,
            self.wrapper,
            self.backend,
            self.cast_weights,
            self.lora,
            self.tf32,
        )

    def fp32_key(self) -> tuple:  # fp32 q/k/v run through flex under `auto` (adaptive) as under `flex`
        return (self.budget, self.lora)


def variants(args) -> list[Variant]:
    """The variants asked for, in the order they run (most telling first)."""
    big = args.big_budget
    table = {
        "base": Variant(),
        f"budget_{big}": Variant(name=f"budget_{big}", budget=big),
        "ckpt_selective": Variant(name="ckpt_selective", checkpointing="selective"),
        "flex": Variant(name="flex", backend="flex", checkpointing="none"),
        "lora": Variant(name="lora", lora=True, checkpointing="none"),
        "static": Variant(name="static", dynamic=False, checkpointing="none"),
        "no_wrapper": Variant(name="no_wrapper", wrapper=False),
        "ckpt_none": Variant(name="ckpt_none", checkpointing="none"),
        "no_cast": Variant(name="no_cast", cast_weights=False),
        "tf32_off": Variant(name="tf32_off", tf32=False),
    }
    names = list(table) if args.variants == "all" else args.variants.split(",")
    picked = []
    for name in names:
        if name.startswith("budget_") and name not in table:
            table[name] = Variant(name=name, budget=int(name.split("_")[1]))
        if name not in table:
            raise SystemExit(f"unknown variant {name!r}; expected some of {sorted(table)}")
        v = table[name]
        if args.budget != 4096 and v.budget == 4096:
            v = replace(v, budget=args.budget)
        picked.append(v)
    return picked


# ---- the regions compiled with static shapes ------------------------------------------------------

_STATIC: dict[tuple, object] = {}
_dynamic_compiled_region = layer_region.compiled_region


def _static_compiled_region(mode: str, backend: str, compile_mode: str | None):
    """`compiled_region` with `dynamic=False`, on a copy of the region function (its own code object, so
    dynamo's cache of the dynamic graphs is not shared with it)."""
    key = (mode, backend, compile_mode)
    if key not in _STATIC:
        f = layer_region._REGIONS[mode]
        code = f.__code__.replace(co_name=f"{f.__name__}_static")
        copy = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
        _STATIC[key] = torch.compile(copy, backend=backend, mode=compile_mode, dynamic=False)
    return _STATIC[key]


@contextlib.contextmanager
def _shapes(dynamic: bool):
    layer_region.compiled_region = _dynamic_compiled_region if dynamic else _static_compiled_region
    try:
        yield
    finally:
        layer_region.compiled_region = _dynamic_compiled_region


# ---- one trainer, its first step recorded ---------------------------------------------------------


class _Record(TrainerCallback):
    """Step 1's gradients before clipping (if the Trainer never clips, before the optimizer step)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0 and self.trainer.record["grads"] is None:
            self.trainer.record["grads"] = _snapshot(self.trainer.model)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


class BisectTrainer(ReplayTrainer):
    """The replay trainer, recording step 1's rows, loss and gradients; optionally autocast around
    `compute_loss` instead of accelerate's wrapper around the forward."""

    outer_autocast = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        device = next(model.parameters()).device
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if self.outer_autocast
            else contextlib.nullcontext()
        )
        with autocast:
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step == 0:
            loss = out[0] if return_outputs else out
            self.record["rows"].append(inputs["row"])
            self.record["loss"] += float(loss.detach())
        return out


def _config(args, v: Variant, kind: str, steps: int) -> AsyncGRPOConfig:
    """`kind`: compiled (amp), eager (amp) or fp32 (no autocast, no TF32, no compile)."""
    cuda = args.device == "cuda"
    kw: dict = dict(
        output_dir=tempfile.mkdtemp(prefix="agrpo-bisect-"), max_steps=steps,
        learning_rate=1e-5 if v.lora else 1e-6, token_budget=v.budget, gradient_accumulation_steps=1,
        max_staleness=10**6, save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, seed=0,
        bf16=kind != "fp32", attention_backend=v.backend, torch_compile=kind == "compiled",
    )  # fmt: skip
    if kind == "compiled":
        kw["torch_compile_backend"] = args.compile_backend
    if v.checkpointing == "none":
        kw["gradient_checkpointing"] = False
    else:
        kw["gradient_checkpointing"], kw["checkpointing_mode"] = True, v.checkpointing
    if cuda:
        kw["tf32"] = v.tf32 if kind != "fp32" else False
    else:
        kw["use_cpu"] = True
    return AsyncGRPOConfig(**kw)


def _train(args, v: Variant, samples, kind: str, steps: int) -> tuple[BisectTrainer, dict]:
    """A fresh model (seed 0) trained `steps` steps by the trainer under `v`; the trainer and its step-1 record."""
    model = build_random_model(args.model, args.layers, args.device, torch.float32)
    peft = None
    if v.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(0)  # LoRA's A matrices: the same in every trainer of a variant
    config = _config(args, v, kind, steps)
    BisectTrainer.replay_samples = samples
    trainer = BisectTrainer(model, None, args=config, train_dataset=[{"prompt": "x"}], processing_class=build_tokenizer(), peft_config=peft)  # fmt: skip
    trainer.record = {"rows": [], "loss": 0.0, "grads": None}
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_Record(trainer))
    if not v.cast_weights:
        regions = trainer._layer_regions
        regions.settings = replace(regions.settings, cast_weights=False)
    if not v.wrapper and kind != "fp32":
        trainer.accelerator.native_amp = False  # no autocast wrapper in prepare_model
        trainer.outer_autocast = True
    clip = trainer.accelerator.clip_grad_norm_

    def clip_recording(parameters, *a, **k):
        if trainer.state.global_step == 0 and trainer.record["grads"] is None:
            trainer.record["grads"] = _snapshot(trainer.model)
        return clip(parameters, *a, **k)

    trainer.accelerator.clip_grad_norm_ = clip_recording
    with (
        _shapes(v.dynamic),
        _fp32_matmuls() if kind == "fp32" and args.device == "cuda" else contextlib.nullcontext(),
    ):
        trainer.train()
    record = trainer.record
    record["wrapped"] = "forward" in vars(trainer.model) and hasattr(trainer.model, "_original_forward")
    return trainer, record


def _free() -> None:
    """Give memory back once the caller dropped its references (trainers hold models, optimizers, callbacks)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the run -------------------------------------------------------------------------------------


def run_variant(args, v: Variant, samples, refs: dict) -> dict:
    start = time.perf_counter()
    out: dict = {"variant": v.name, "settings": asdict(v)}
    before = graph_counts()
    trainer, rec_c = _train(args, v, samples, "compiled", args.steps)
    regions = trainer._layer_regions
    out["compiled"] = {
        "layers": regions.num_layers, "compiled_layers": sum(r.compiled for r in regions.regions),
        "checkpointing": regions.mode, "layer_modes": regions.layer_modes, "wrapped": rec_c["wrapped"],
        "new_graphs": graph_counts()["graphs"] - before["graphs"],
        "graph_breaks": graph_counts()["graph_breaks"] - before["graph_breaks"],
        "step1_row_tokens": [int(r.num_tokens) for r in rec_c["rows"]], "train_s": time.perf_counter() - start,
    }  # fmt: skip
    if args.post:  # trainer_run's two rows; static shapes: step 1's rows (each new row size is a new compile)
        rows = plan_rows(
            [PackSample(**s.pack_fields()) for s in samples[:64]], v.budget, share_prefixes=True
        )[:2]
        rows = rows if v.dynamic else rec_c["rows"]
        out["post"] = post_parity(trainer, rows, _shapes(v.dynamic), args.device)
        out["post"]["row_tokens"] = [int(r.num_tokens) for r in rows]
    g_c, loss_c, rows_c = rec_c["grads"], rec_c["loss"], _row_key(rec_c["rows"])
    del trainer, regions
    _free()
    for kind, key in (("eager", v.eager_key()), ("fp32", v.fp32_key())):
        if (kind, key) not in refs:
            t, rec = _train(args, v, samples, kind, 1)
            refs[(kind, key)] = {"grads": rec["grads"], "loss": rec["loss"], "rows": _row_key(rec["rows"]),
                                 "wrapped": rec["wrapped"]}  # fmt: skip
            del t, rec
            _free()
    e, r = refs[("eager", v.eager_key())], refs[("fp32", v.fp32_key())]
    out["step1"] = {
        **_compare(g_c, e["grads"], r["grads"]), **_loss_gaps(loss_c, e["loss"], r["loss"]),
        "same_rows": rows_c == e["rows"] == r["rows"], "rows": rows_c, "eager_wrapped": e["wrapped"],
    }  # fmt: skip
    out["seconds"] = time.perf_counter() - start
    print_variant(v.name, out)
    return out


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--steps", type=int, default=2, help="steps of the compiled trainer (step 1 is compared)"
    )
    parser.add_argument("--budget", type=int, default=4096, help="the base token budget")
    parser.add_argument("--big-budget", type=int, default=16384, help="the budget_N variant's")
    parser.add_argument("--variants", default="all", help="comma list (see `variants`) or all")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--no-post", dest="post", action="store_false", help="skip trainer_run's own check")
    parser.add_argument("--time-budget", type=float, default=400.0, help="seconds; no variant starts after")
    parser.add_argument("--rollouts", default=str(ROLLOUTS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, 2 steps, small rows")
    args = parser.parse_args()
    if args.tiny:
        args.device, args.model, args.layers, args.steps = "cpu", "tiny-dense", 2, min(args.steps, 2)
        args.budget, args.big_budget = min(args.budget, 512), min(args.big_budget, 1024)
        if args.variants == "all":
            args.variants = f"base,no_wrapper,budget_{args.big_budget},ckpt_selective,lora,static,no_cast"
    if args.device == "cpu" and args.variants == "all":  # flex trains on CUDA only; TF32 is CUDA's
        args.variants = (
            f"base,no_wrapper,budget_{args.big_budget},ckpt_none,ckpt_selective,lora,static,no_cast"
        )
    args.json = args.json or os.path.join(os.environ.get("OUT", "."), "gpu_bisect.json")
    return args


def main() -> None:
    args = _arguments()
    for name, value in (
        ("recompile_limit", 64),
        ("cache_size_limit", 64),
        ("accumulated_recompile_limit", 4096),
    ):
        if hasattr(torch._dynamo.config, name):  # variants share the regions' compiled functions
            setattr(torch._dynamo.config, name, value)
    start = time.perf_counter()
    samples = load(args.rollouts)
    base = build_random_model(args.model, args.layers, args.device, torch.float32)
    enable_tree_attention(base, "reference" if args.device == "cpu" else "auto")
    samples = rescored(samples, base, amp=True)
    del base
    _free()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{len(samples)} samples; {args.model} x {args.layers} layers on {device}, torch {torch.__version__}",
        flush=True,
    )
    payload: dict = {"args": vars(args), "device": device, "torch": torch.__version__, "results": []}
    refs: dict = {}
    durations: list[float] = []
    for v in variants(args):
        left = args.time_budget - (time.perf_counter() - start)
        if durations and left < min(durations):
            print(f"== {v.name} skipped: {left:.0f} s left", flush=True)
            payload["results"].append({"variant": v.name, "skipped": f"{left:.0f} s left"})
            continue
        began = time.perf_counter()
        try:
            result = run_variant(args, v, samples, refs)
        except Exception as error:  # noqa: BLE001 (one variant failing must not cost the others)
            import traceback

            traceback.print_exc()
            result = {"variant": v.name, "error": f"{type(error).__name__}: {error}"}
            _free()
        durations.append(time.perf_counter() - began)
        later = variants(args)[[x.name for x in variants(args)].index(v.name) + 1 :]
        needed = {("eager", x.eager_key()) for x in later} | {("fp32", x.fp32_key()) for x in later}
        for key in [k for k in refs if k not in needed]:  # references no later variant compares against
            del refs[key]
        _free()
        payload["results"].append(result)
        dump(args.json, payload)
    payload["seconds"] = time.perf_counter() - start
    dump(args.json, payload)
    print(f"total {payload['seconds']:.0f} s; JSON {args.json}", flush=True)


if __name__ == "__main__":
    main()
