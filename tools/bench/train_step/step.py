"""One optimizer step of the trainer's own step code, timed piece by piece.

Owns `plan_rows` (samples -> `agrpo_packing.Planner` -> one row per micro-batch, as the trainer's
packing thread does) and `timed_step`: for every row `agrpo_trainer._step.micro_batch_loss` (tree
attention, gathered log-probs and the sampler top-K of score centering, `grpo_loss`) and its backward,
then the optimizer step, exactly the calls the trainer makes. Time is split with CUDA events (wall clock
on CPU): forward up to the LM head, LM head + log-probs + loss, backward (with the recompute when
gradient checkpointing is on), optimizer. `gpu_busy_fraction` profiles one step and returns the share of
its span during which some kernel ran: the rest is the GPU waiting for the host (planning, collation,
launches). Does not know model shapes or reporting.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from agrpo_packing import PackedRow, PackingConfig, PackSample, Planner
from agrpo_trainer._loss import LossSettings
from agrpo_trainer._step import StepSettings, micro_batch_loss

SETTINGS = StepSettings(
    loss=LossSettings(epsilon=0.2, epsilon_high=0.2, is_clip_min=0.0, is_clip_max=3.0, score_centering=True),
    temperature=1.0,
    router_aux_loss_coef=0.0,
    truncated_sampling=False,
)
"""The reference's loss defaults with score centering on."""


def plan_rows(samples: list[PackSample], budget: int, *, share_prefixes: bool) -> list[PackedRow]:
    """One packed row per micro-batch (one rank), in the planner's order."""
    planner = Planner(PackingConfig(token_budget=budget, share_prefixes=share_prefixes))
    batches = [b for sample in samples for b in planner.add(sample)]
    tail = planner.flush()
    batches += [tail] if tail is not None else []
    return [batch.pack()[0] for batch in batches]


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


def timed_step(model, optimizer, rows: list[PackedRow], *, amp: bool) -> StepTimes:
    """One optimizer step over `rows` (one micro-batch each), as the trainer runs it."""
    device = next(model.parameters()).device
    clock, times = _Clock(device), StepTimes()
    head_marks: list = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda *_: head_marks.append(clock.mark()))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    step_tokens = sum(row.num_loss_terms for row in rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall = time.perf_counter()
    marks = []
    try:
        for row in rows:
            start = clock.mark()
            with autocast:
                loss, _ = micro_batch_loss(
                    model, row.to(device), SETTINGS, step_trained_tokens=step_tokens, world_size=1,
                    micro_batches_per_step=len(rows),
                )  # fmt: skip
            scored = clock.mark()
            loss.backward()
            marks.append((start, head_marks[-1], scored, clock.mark()))
        before_optimizer = clock.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = clock.mark()
    finally:
        hook.remove()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    times.total_s = time.perf_counter() - wall
    for start, head, scored, backward in marks:
        times.forward_s += clock.seconds(start, head)
        times.head_s += clock.seconds(head, scored)
        times.backward_s += clock.seconds(scored, backward)
    times.optimizer_s = clock.seconds(before_optimizer, done)
    return times


def gpu_busy_fraction(run) -> float:
    """Share of the span of `run()`'s GPU work during which at least one kernel ran (profiled once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return 0.0
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in spans) - spans[0][0]
    return busy / span if span > 0 else 1.0
