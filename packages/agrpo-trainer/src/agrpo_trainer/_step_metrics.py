"""One optimizer step's metrics: its clock (`perf/*`), its micro-batches (`batch/*`, `sample/*`), its samples'
rewards and the loss statistics (`sampling/*`), named as SPEC F-MET names them ("step" = optimizer step).

Owns `StepClock` (wall time between steps, forward+backward intervals and their forward part, optimizer
time, tokens and model FLOPs, and the overlap of packing bursts with forward+backward:
`perf/pack_overlap_frac` is the share of the packing thread's time that ran while this rank computed) and
`step_metrics`. On CUDA the clock synchronises around each forward+backward (and at the end of its
forward) so the intervals are the device's. `perf/*` rates and MFU are this rank's: its rows, its time,
its device's peak (`_flops`); MFU is left out when the peak is unknown. Does not know how metrics are
logged.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from agrpo_packing import PackedRow

from ._flops import ModelFlops
from ._loss import LossStats


def _sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """Times one optimizer step; `take` returns its `perf/*` and starts the next."""

    def __init__(self) -> None:
        self._last_step_end = time.perf_counter()
        self.fwd_bwd_intervals: list[tuple[float, float]] = []
        self.fwd_s = 0.0
        self._optimizer_start = 0.0
        self.optimizer_s = 0.0
        self.forwarded_tokens = 0
        self.trained_tokens = 0
        self.run_forwarded_tokens = 0
        """Every rank's forwarded tokens since training started (`num_tokens`), counted from rank 0's batches."""
        self.flops = 0.0
        self.flop_model: ModelFlops | None = None
        """Set with `peak_flops` once the model is on its device; without both, no MFU."""
        self.peak_flops: float | None = None

    def step_started(self) -> None:
        self.fwd_bwd_intervals.clear()
        self.forwarded_tokens = self.trained_tokens = 0
        self.fwd_s = self.flops = 0.0

    @contextlib.contextmanager
    def fwd_bwd(self) -> Iterator[None]:
        _sync_device()
        start = time.perf_counter()
        yield
        _sync_device()
        self.fwd_bwd_intervals.append((start, time.perf_counter()))

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Inside `fwd_bwd`: the forward part (the loss included)."""
        start = time.perf_counter()
        yield
        _sync_device()
        self.fwd_s += time.perf_counter() - start

    def add_tokens(self, row: PackedRow) -> None:
        self.forwarded_tokens += row.num_tokens
        self.trained_tokens += row.num_loss_terms
        if self.flop_model is not None:
            self.flops += self.flop_model.row_flops(row)

    def optimizer_started(self) -> None:
        self._optimizer_start = time.perf_counter()

    def optimizer_finished(self) -> None:
        _sync_device()
        self.optimizer_s = time.perf_counter() - self._optimizer_start

    def overlap(self, pack_intervals: list[tuple[float, float]]) -> float:
        """Share of packing time that overlapped this step's forward+backward (1.0 = fully hidden)."""
        total = sum(end - start for start, end in pack_intervals)
        if total <= 0:
            return float("nan")
        hidden = sum(
            max(0.0, min(p_end, f_end) - max(p_start, f_start))
            for p_start, p_end in pack_intervals
            for f_start, f_end in self.fwd_bwd_intervals
        )
        return hidden / total

    def take(self) -> dict[str, float]:
        now = time.perf_counter()
        step_s, self._last_step_end = now - self._last_step_end, now
        fwd_bwd_s = sum(end - start for start, end in self.fwd_bwd_intervals)
        out = {
            "perf/step_s": step_s,
            "perf/fwd_bwd_s": fwd_bwd_s,
            "perf/fwd_s": self.fwd_s,
            "perf/optimizer_s": self.optimizer_s,
            "perf/forwarded_tok_s_fwd_bwd": self.forwarded_tokens / fwd_bwd_s if fwd_bwd_s else 0.0,
            "perf/forwarded_tok_s_wall_clock": self.forwarded_tokens / step_s if step_s else 0.0,
            "perf/trained_tok_s_wall_clock": self.trained_tokens / step_s if step_s else 0.0,
        }
        if self.peak_flops and self.flop_model is not None and fwd_bwd_s and step_s:
            out["perf/mfu_fwd_bwd"] = self.flops / (fwd_bwd_s * self.peak_flops)
            out["perf/mfu_wall_clock"] = self.flops / (step_s * self.peak_flops)
        return out


def all_ranks(stats: LossStats) -> LossStats:
    """The step's loss statistics over every rank (sums add, maxima take the max)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    sums, maxima = stats.to_tensors()
    sums, maxima = sums.clone(), maxima.clone()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return LossStats.from_tensors(sums, maxima)


def _trained_reward(samples: list) -> float:
    """Mean reward of the rollouts the step trained, each once however many samples it forked into."""
    by_rollout = {(s.group_id, s.rollout_id or id(s)): s.reward for s in samples}
    scored = [r for r in by_rollout.values() if not np.isnan(r)]
    return float(np.mean(scored)) if scored else float("nan")


def _sample_metrics(samples: list) -> dict[str, float]:
    if not samples:
        return {}
    lengths = [s.num_tokens for s in samples]
    out = {
        "sample/forwarded_tokens_mean": float(np.mean(lengths)),
        "sample/forwarded_tokens_max": float(np.max(lengths)),
        "sample/trained_tokens_mean": float(np.mean([s.num_trained for s in samples])),
        "reward_group_std": float(np.mean([s.group_reward_std for s in samples])),
        "reward": _trained_reward(samples),
    }
    by_func, std_by_func = defaultdict(list), defaultdict(list)
    for sample in samples:
        for name, value in sample.rewards_by_func.items():
            by_func[name].append(value)
            std_by_func[name].append(sample.group_rewards_by_func_std.get(name, np.nan))
    for name, values in by_func.items():
        out[f"rewards/{name}/mean"] = (
            float(np.nanmean(values)) if not np.all(np.isnan(values)) else float("nan")
        )
        out[f"rewards/{name}/group_std"] = float(np.nanmean(std_by_func[name]))
    return out


def step_metrics(batches: list, stats: LossStats, clock: StepClock) -> dict[str, float]:
    """Everything one optimizer step reports (batches are rank 0's view of every rank's rows)."""
    out = clock.take()
    out.update(
        {k: v for k, v in stats.metrics().items() if k != "num_terms"}
    )  # = batch/trained_tokens_per_step
    real = [b for b in batches if b.samples]
    if not real:
        return out
    samples = [s for b in real for s in b.samples]
    forwarded = sum(row.num_tokens for b in batches for row in b.rows)
    trained = sum(b.num_loss_terms for b in batches)
    raw = sum(row.num_raw_tokens for b in batches for row in b.rows)
    clock.run_forwarded_tokens += forwarded
    for name in (n for n in real[0].metrics if not n.endswith("_total")):  # the stream counts drops
        out[name] = float(np.mean([b.metrics[name] for b in real if name in b.metrics]))
    out.update(
        {
            "batch/forwarded_tokens_per_step": float(forwarded),
            "batch/trained_tokens_per_step": float(trained),
            "batch/samples_per_step": float(len(samples)),
            "batch/groups_per_step": float(len({s.group_id for s in samples})),
            "batch/microbatches_per_step": float(len(real)),
            "batch/masked_token_frac": 1.0 - trained / raw if raw else 0.0,
            "num_tokens": float(clock.run_forwarded_tokens),
        }
    )
    out.update(_sample_metrics(samples))
    return out
