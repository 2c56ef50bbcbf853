"""One optimizer step of the trainer's own step code, timed piece by piece.

Owns `plan_rows` (samples -> `agrpo_packing.Planner` -> one row per micro-batch, as the trainer's
packing thread does) and `timed_step`: for every row `agrpo_trainer._step.micro_batch_loss` (tree
attention, gathered log-probs and the sampler top-K of score centering, `grpo_loss`) and its backward,
then the optimizer step, exactly the calls the trainer makes. Time is split with CUDA events (wall clock
on CPU): forward up to the LM head, LM head + log-probs + loss, backward (with the recompute when
gradient checkpointing is on), optimizer. Rows reach the device by one of `ROW_PATHS`: by default
`inline`, as the trainer's do (pinned, non-blocking copies and the plan built just before the forward);
`sequential` (pageable copies, the plan built by `token_scores`) is kept to measure what that saves. (A
prefetching worker thread was measured 18% slower at ratio 8 on the H200 and removed, 2026-12-05.)
`gpu_idle_profile` profiles one step and returns the share of its GPU span during which no kernel ran
(the GPU waiting for the host: planning, collation, syncs, launches), split into gaps of 1 ms or more
and shorter ones, with the busy time split by kernel kind (matmul, attention, compiled Triton, copies and
casts, optimizer; `kernel_split`). Does not know model shapes or reporting.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from agrpo_packing import PackedRow, PackingConfig, PackSample, Planner
from agrpo_trainer._device_row import DeviceRow, prepare_device_row
from agrpo_trainer._loss import LossSettings
from agrpo_trainer._step import StepSettings, micro_batch_loss

SETTINGS = StepSettings(
    loss=LossSettings(epsilon=0.2, epsilon_high=0.2, is_clip_min=0.0, is_clip_max=3.0, score_centering=True),
    temperature=1.0,
    router_aux_loss_coef=0.0,
    truncated_sampling=False,
)
"""The reference's loss defaults with score centering on."""


def plan_batches(
    samples: list[PackSample], budget: int, *, share_prefixes: bool, num_ranks: int = 1
) -> list[list[PackedRow]]:
    """The step's micro-batches in the planner's order, each `num_ranks` packed rows (rank r trains row r)."""
    planner = Planner(PackingConfig(token_budget=budget, share_prefixes=share_prefixes, num_ranks=num_ranks))
    batches = [b for sample in samples for b in planner.add(sample)]
    tail = planner.flush()
    batches += [tail] if tail is not None else []
    return [batch.pack() for batch in batches]


def plan_rows(samples: list[PackSample], budget: int, *, share_prefixes: bool) -> list[PackedRow]:
    """One packed row per micro-batch (one rank), in the planner's order."""
    return [rows[0] for rows in plan_batches(samples, budget, share_prefixes=share_prefixes)]


class _Clock:
    """Marks on the device's timeline: CUDA events, or the wall clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass(slots=True)
class StepTimes:
    """Seconds of one optimizer step by part, and its peak memory."""

    forward_s: float = 0.0
    head_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    total_s: float = 0.0
    peak_gib: float = 0.0
    loss: float = 0.0
    """This rank's step loss: the sum of its rows' scaled losses (over all ranks they sum to the token mean
    times the world size, since gradients are averaged over ranks)."""


ROW_PATHS = ("inline", "sequential")
"""How rows reach the device: `inline` (the trainer's) prepares each (pinned, non-blocking copies, plan built)
just before its forward; `sequential` copies it from pageable memory and lets `token_scores` plan."""


def _device_rows(model, rows: list[PackedRow], path: str):
    """What the step trains on, row by row, by `path` (see `ROW_PATHS`)."""
    device = next(model.parameters()).device
    if path not in ROW_PATHS:
        raise ValueError(f"row path {path!r}; expected one of {ROW_PATHS}")
    if path == "sequential":
        yield from (DeviceRow(row=row.to(device), plan=None) for row in rows)
    else:
        yield from (prepare_device_row(row, model) for row in rows)


def timed_step(
    model, optimizer, rows: list[PackedRow], *, amp: bool, path: str = "inline", world_size: int = 1,
    step_tokens: int | None = None, before_optimizer=None,
) -> StepTimes:  # fmt: skip
    """One optimizer step over `rows` (one micro-batch each), as the trainer runs it. With several ranks,
    `rows` are this rank's and `step_tokens` the trained tokens of the whole step (all ranks).
    `before_optimizer()` runs where the Trainer's `on_pre_optimizer_step` callbacks do."""
    device = next(model.parameters()).device
    clock, times = _Clock(device), StepTimes()
    head_marks: list = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda *_: head_marks.append(clock.mark()))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    step_tokens = sum(row.num_loss_terms for row in rows) if step_tokens is None else step_tokens
    loss_sum = torch.zeros((), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall = time.perf_counter()
    marks = []
    try:
        for prepared in _device_rows(model, rows, path):
            start = clock.mark()
            with autocast:
                loss, _ = micro_batch_loss(
                    model, prepared.row, SETTINGS, step_trained_tokens=step_tokens, world_size=world_size,
                    micro_batches_per_step=len(rows), plan=prepared.plan,
                )  # fmt: skip
            scored = clock.mark()
            loss.backward()
            loss_sum += loss.detach().float()
            marks.append((start, head_marks[-1], scored, clock.mark()))
        if before_optimizer is not None:
            before_optimizer()
        optimizer_start = clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = clock.mark()
    finally:
        hook.remove()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    times.total_s = time.perf_counter() - wall
    times.loss = float(loss_sum)
    for start, head, scored, backward in marks:
        times.forward_s += clock.seconds(start, head)
        times.head_s += clock.seconds(head, scored)
        times.backward_s += clock.seconds(scored, backward)
    times.optimizer_s = clock.seconds(optimizer_start, done)
    return times


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _innermost_cpu_op(events, at: float) -> str:
    """Name of the shortest host-side op running at time `at` (us): what the host did while the GPU waited."""
    best = None
    for e in events:
        if e.time_range.start <= at <= e.time_range.end and (
            best is None or e.time_range.elapsed_us() < best[0]
        ):
            best = (e.time_range.elapsed_us(), e.name)
    return best[1] if best else "?"


_KERNEL_KINDS = (
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("attention", ("flash", "fmha", "attn", "flex", "triton_tem")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "splitk")),
    ("compiled (triton)", ("triton_",)),
    ("copy / cast / fill", ("copy", "memcpy", "memset", "fill", "cast", "convert")),
    ("other eager elementwise / reduce", ("elementwise", "vectorized", "reduce", "index", "scatter", "gather")),
)
"""Kernel name fragments (lower case) -> kind, first match wins; everything else is "other"."""


def kernel_split(events) -> dict:
    """Share of the GPU's busy time per kernel kind (`_KERNEL_KINDS`), and the twelve costliest kernels (ms, calls)."""
    per_kind: dict[str, float] = {}
    per_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name, us = e.name, e.time_range.elapsed_us()
        lower = name.lower()
        kind = next((k for k, parts in _KERNEL_KINDS if any(p in lower for p in parts)), "other")
        per_kind[kind] = per_kind.get(kind, 0.0) + us
        per_name[name] = per_name.get(name, 0.0) + us
        calls[name] = calls.get(name, 0) + 1
    total = sum(per_kind.values()) or 1.0
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "kinds": {k: round(v / total, 4) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "busy_ms": round(total / 1e3, 1),
        "top_kernels_ms": [(name[:90], round(us / 1e3, 1), calls[name]) for name, us in top],
    }


def gpu_idle_profile(run, *, host_ops: bool = False) -> dict:
    """Profile `run()` once: the share of its GPU span with no kernel running, the share of it spent in gaps of
    1 ms or more (host stalls: syncs, planning) rather than launch gaps, and with `host_ops` the host op
    running at the start of the largest gaps (the CPU profile slows the host, so idle reads higher)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host_ops else [])
    with profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    events = prof.events()
    busy = _merged([
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ])  # fmt: skip
    if not busy:
        return {"idle_frac": 1.0, "long_gap_frac": 0.0, "long_gaps": 0}
    span = busy[-1][1] - busy[0][0]
    gaps = [(b[0] - a[1], a[1]) for a, b in zip(busy, busy[1:], strict=False)]
    long_gaps = sorted((g for g in gaps if g[0] >= 1000.0), reverse=True)
    out = {
        "idle_frac": sum(g for g, _ in gaps) / span if span > 0 else 0.0,
        "long_gap_frac": sum(g for g, _ in long_gaps) / span if span > 0 else 0.0,
        "long_gaps": len(long_gaps),
        "kernel_split": kernel_split(events),
    }
    if host_ops:
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        out["long_gap_host_ops"] = [
            (round(g / 1e3, 1), _innermost_cpu_op(cpu, at + 1.0)) for g, at in long_gaps[:6]
        ]
    return out
