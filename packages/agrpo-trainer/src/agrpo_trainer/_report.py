"""The run report: `<output_dir>/report.html`, one self-contained page of the run's curves over optimizer steps.

Owns `PANELS` (which logged metrics are drawn together, and why), `write_report` (the page, from the
Trainer's `log_history`) and `RunReport` (the callback that writes it when training ends, on world
process zero). Plotly draws it: its HTML embeds plotly.js, so the page opens offline with zoom and hover,
and the plotted numbers sit in the page as JSON, where a test reads them back. Does not compute metrics:
it reads the names `_step_metrics`, the loss, weight sync and the rollout process log (SPEC F-MET).
"""

from __future__ import annotations

import fnmatch
import html
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger("agrpo_trainer")

REPORT_NAME = "report.html"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    metrics: tuple[str, ...]
    """Logged names drawn as one line each (`*` matches any part: one line per reward function); absent
    ones are left out."""


# fmt: off
PANELS = (
    Panel("reward", ("reward", "rollout/window_reward", "rollout/window_reward_kept")),
    Panel("reward per function", ("rewards/*/mean",)),
    Panel("reward spread", ("reward_group_std", "rollout/window_frac_reward_zero_std")),
    Panel("distance to the sampler", ("kl", "sampling/sampling_logp_difference/mean",
                                      "sampling/sampling_logp_difference/max")),
    Panel("importance sampling", ("sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
                                  "sampling/importance_sampling_ratio/max", "sampling/masked_mean")),
    Panel("tokens/s", ("perf/forwarded_tok_s_wall_clock", "perf/forwarded_tok_s_fwd_bwd",
                       "perf/trained_tok_s_wall_clock", "rollout/generated_tok_s")),
    Panel("concurrency (rollouts)", ("rollout/concurrency_cap", "rollout/concurrency",
                                     "rollout/vllm_running_requests", "rollout/vllm_queued_requests")),
    Panel("vLLM KV cache usage (fraction)", ("rollout/kv_cache_usage",)),
    Panel("weight sync (s)", ("perf/weight_sync_s", "perf/weight_sync_transfer_s", "perf/weight_sync_pause_s",
                              "perf/weight_sync_stage_s", "perf/weight_sync_barrier_s")),
    Panel("step time (s)", ("perf/step_s", "perf/fwd_bwd_s", "perf/rollout_wait_s", "perf/optimizer_s")),
    Panel("queues (samples, groups)", ("sample/rollout_queue_size", "rollout/score_queue_size")),
    Panel("sample age", ("sample/staleness_mean", "sample/staleness_max", "sample/time_in_queue_s")),
)
# fmt: on

_COLUMNS = 2


def curve(log_history: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one logged metric; NaNs and entries without a step are skipped."""
    points = [
        (int(entry["step"]), float(entry[name]))
        for entry in log_history
        if name in entry
        and "step" in entry
        and isinstance(entry[name], int | float)
        and math.isfinite(entry[name])
    ]
    return [s for s, _ in points], [v for _, v in points]


def _names(log_history: list[dict], pattern: str) -> list[str]:
    if "*" not in pattern:
        return [pattern]
    return sorted({k for entry in log_history for k in entry if fnmatch.fnmatchcase(k, pattern)})


def _panel_curves(log_history: list[dict]) -> list[tuple[Panel, list[tuple[str, tuple]]]]:
    """The panels that have a point, each with its (name, (steps, values)) lines."""
    out = []
    for panel in PANELS:
        names = [n for pattern in panel.metrics for n in _names(log_history, pattern)]
        curves = [(n, c) for n in names if (c := curve(log_history, n))[0]]
        if curves:
            out.append((panel, curves))
    return out


def _figure(log_history: list[dict]):
    from plotly.graph_objects import Scatter
    from plotly.subplots import make_subplots

    panels = _panel_curves(log_history)
    rows = max(math.ceil(len(panels) / _COLUMNS), 1)
    figure = make_subplots(rows=rows, cols=_COLUMNS, subplot_titles=[p.title for p, _ in panels],
                           vertical_spacing=0.3 / rows, horizontal_spacing=0.07)  # fmt: skip
    last_step = max((s for _, curves in panels for _, (steps, _) in curves for s in steps), default=1)
    for i, (_, curves) in enumerate(panels):
        row, col, legend = i // _COLUMNS + 1, i % _COLUMNS + 1, f"legend{i + 1}" if i else "legend"
        for name, (steps, values) in curves:
            trace = Scatter(x=steps, y=values, name=name, mode="lines+markers", legend=legend)
            figure.add_trace(trace, row=row, col=col)
        axis = figure.get_subplot(row, col)
        figure.update_layout(
            {
                legend: {
                    "x": axis.xaxis.domain[1],
                    "y": axis.yaxis.domain[1],
                    "xanchor": "right",
                    "yanchor": "top",
                    "bgcolor": "rgba(255,255,255,0.7)",
                    "font": {"size": 10},
                }
            }
        )
        figure.update_xaxes(
            title_text="optimizer step", dtick=max(1, round(last_step / 10)), row=row, col=col
        )
    figure.update_layout(
        height=320 * rows, template="plotly_white", margin={"t": 40, "b": 40, "l": 50, "r": 20}
    )
    return figure


def _summary(log_history: list[dict], title: str) -> str:
    final = next((e for e in reversed(log_history) if "train_runtime" in e), {})
    steps = max((int(e["step"]) for e in log_history if "step" in e), default=0)
    facts = [("optimizer steps", str(steps)), ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    if final:
        facts.append(("train runtime", f"{final['train_runtime']:.1f} s"))
    for name in ("reward", "kl", "perf/forwarded_tok_s_wall_clock"):
        _, values = curve(log_history, name)
        if values:
            facts.append((f"{name} (first, last)", f"{values[0]:.4g}, {values[-1]:.4g}"))
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    return f"<h1>{html.escape(title)}</h1><table class='facts'>{cells}</table>"


_STYLE = """body{font-family:system-ui,sans-serif;margin:16px 24px;color:#222}h1{font-size:20px;margin:0 0 8px}
.facts{border-collapse:collapse;font-size:13px;margin-bottom:8px}.facts th{text-align:left;padding:2px 12px 2px 0;
font-weight:600}.facts td{padding:2px 0}"""


def write_report(log_history: list[dict], path: Path, *, title: str = "agrpo run") -> Path | None:
    """The page at `path`; None when no panel has a point (nothing was logged with a step)."""
    figure = _figure(log_history)
    if not figure.data:
        return None
    plot = figure.to_html(full_html=False, include_plotlyjs=True, div_id="agrpo-report",
                          config={"displaylogo": False, "responsive": True})  # fmt: skip
    page = (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body>{_summary(log_history, title)}{plot}</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


class RunReport(TrainerCallback):
    """Writes `<output_dir>/report.html` when training ends (world process zero)."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def on_train_end(self, args, state, control, **kwargs):
        if not (state.is_world_process_zero and state.log_history):
            return
        title = f"agrpo run: {args.run_name or Path(args.output_dir).name}"
        try:
            self.path = write_report(state.log_history, Path(args.output_dir) / REPORT_NAME, title=title)
        except ImportError as exc:  # a source checkout without the declared dependency: keep the trained run
            logger.warning("no %s: %s (pip install plotly, or install agrpo-trainer with its dependencies)",
                           REPORT_NAME, exc)  # fmt: skip
            return
        if self.path is not None:
            logger.info("run report: %s", self.path)
