"""What `gpu_bisect.py` compares, prints and keeps: the parity rule applied to compiled / eager / fp32 gradients
with the per-layer table, the loss gaps, `trainer_run.py`'s check redone with a true fp32 reference beside its
own, one variant's lines, and the JSON rewritten after each variant."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace

from agrpo_trainer._layer_region import LayerRegions

from .compile_summary import PARITY_SLACK
from .regions import _LAYER, _fp32_matmuls, _grad_distance, _layer, _loss_and_grads, unwrapped_forward


def _compare(c: dict, e: dict, r: dict) -> dict:
    """Compiled `c` and eager `e` gradients against the fp32 `r`: the parity rule and the per-layer table."""
    dc, de = _grad_distance(c, r), _grad_distance(e, r)
    ratio = dc["rel"] / max(de["rel"], 1e-12)
    layers = sorted({int(m.group(1)) for m in map(_LAYER.search, r) if m})
    return {
        "grad_err_compiled": dc["rel"], "grad_err_eager": de["rel"], "grad_err_ratio": ratio,
        "passed": ratio <= PARITY_SLACK, "cosine_compiled": dc["cosine"], "cosine_eager": de["cosine"],
        "norm_compiled": dc["norm_ratio"], "norm_eager": de["norm_ratio"],
        "worst_compiled": dc["worst_name"], "compiled_vs_eager": _grad_distance(c, e)["rel"],
        "by_layer": {i: (_grad_distance(_layer(c, i), _layer(r, i))["rel"],
                         _grad_distance(_layer(e, i), _layer(r, i))["rel"]) for i in layers},
    }  # fmt: skip


def _loss_gaps(c: float, e: float, r: float) -> dict:
    return {"loss_compiled": c, "loss_eager": e, "loss_fp32": r,
            "loss_gap_compiled": abs(c - r) / max(abs(r), 1e-12), "loss_gap_eager": abs(e - r) / max(abs(r), 1e-12)}  # fmt: skip


def post_parity(trainer, rows, shapes, amp_device: str) -> dict:
    """`trainer_run.py`'s check on the trained model (compiled regions, eager regions, fp32), with the fp32 pass
    both as trainer_run runs it (wrapper on) and through the unwrapped forward. `shapes`: the variant's compile
    context (dynamic or static shapes)."""
    model, regions, settings = trainer.model, trainer._layer_regions, trainer.step_settings
    fp32 = _fp32_matmuls() if amp_device == "cuda" else contextlib.nullcontext()
    with shapes:
        loss_c, g_c = _loss_and_grads(model, rows, settings, amp=True)
    regions.uninstall()
    eager = LayerRegions(replace(regions.settings, compile=False, checkpointing=regions.mode)).install(model)
    try:
        loss_e, g_e = _loss_and_grads(model, rows, settings, amp=True)
        with fp32:
            loss_w, g_w = _loss_and_grads(model, rows, settings, amp=False)
            with unwrapped_forward(model) as was_wrapped:
                loss_r, g_r = _loss_and_grads(model, rows, settings, amp=False)
    finally:
        eager.uninstall()
        regions.install(model)
    out = {
        "model_forward_wrapped": was_wrapped,
        "as_trainer_run": {**_compare(g_c, g_e, g_w), **_loss_gaps(loss_c, loss_e, loss_w)},
        "true_fp32": {**_compare(g_c, g_e, g_r), **_loss_gaps(loss_c, loss_e, loss_r)},
        "trainer_run_ref_vs_true_fp32": _grad_distance(g_w, g_r)["rel"],
    }
    return out


def _row_key(rows) -> list[tuple[int, int]]:
    return [(int(r.num_tokens), int(r.input_ids.sum())) for r in rows]


def _line(tag: str, p: dict) -> str:
    layers = " ".join(f"{i}:{c:.2e}/{e:.2e}" for i, (c, e) in p["by_layer"].items())
    return (
        f"  {tag:<22} ratio {p['grad_err_ratio']:.2f} {'PASS' if p['passed'] else 'FAIL'} | grad err c/e "
        f"{p['grad_err_compiled']:.2e}/{p['grad_err_eager']:.2e} cos {p['cosine_compiled']:.4f}/{p['cosine_eager']:.4f} "
        f"norm {p['norm_compiled']:.3f}/{p['norm_eager']:.3f} c-vs-e {p['compiled_vs_eager']:.2e} | loss gap c/e "
        f"{p['loss_gap_compiled']:.1e}/{p['loss_gap_eager']:.1e}\n    per layer c/e: {layers}"
    )


def print_variant(name: str, out: dict) -> None:
    """One variant's result: its compile facts, then the parity lines (step 1, and trainer_run's check)."""
    c = out["compiled"]
    print(
        f"== {name}: {c['compiled_layers']}/{c['layers']} layers compiled, checkpointing {c['checkpointing']}, "
        f"forward wrapped {c['wrapped']}, step-1 rows {c['step1_row_tokens']} tokens, new graphs {c['new_graphs']}, "
        f"breaks {c['graph_breaks']}, same rows {out['step1']['same_rows']}, {out['seconds']:.0f} s",
        flush=True,
    )
    print(_line("step 1 of train()", out["step1"]), flush=True)
    if "post" in out:
        print(_line("post, as trainer_run", out["post"]["as_trainer_run"]), flush=True)
        print(_line("post, true fp32 ref", out["post"]["true_fp32"]), flush=True)
        print(
            f"    trainer_run's fp32 reference vs the true one: {out['post']['trainer_run_ref_vs_true_fp32']:.2e}"
        )


def dump(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
