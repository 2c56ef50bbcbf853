"""What a person watching a run sees: a live progress bar, and a summary picture when training ends.

Owns `TrainingProgress` (the Trainer's tqdm bar, with reward, KL to the sampler and throughput as its
postfix instead of a printed dict of every metric per step) and `RunSummary` (`<output_dir>/summary.png`:
reward, KL-to-sampler and tokens/s over optimizer steps, from the Trainer's `log_history`). Does not
compute metrics; reads the names `_step_metrics` and the rollout process log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers.trainer_callback import ProgressCallback, TrainerCallback

logger = logging.getLogger("agrpo_trainer")

# (log key, label in the bar); the first present key of each entry is shown.
_POSTFIX = (
    (("reward",), "reward"),
    (("kl",), "kl"),
    (("perf/forwarded_tok_s_wall_clock",), "tok/s"),
    (("perf/step_s",), "s/step"),
    (("rollout/concurrency_cap",), "cap"),
)

SUMMARY_CURVES = (
    ("reward", "reward (all scored groups)"),
    ("kl", "KL to the sampler (k3)"),
    ("perf/forwarded_tok_s_wall_clock", "forwarded tokens/s (wall clock)"),
)


class TrainingProgress(ProgressCallback):
    """The step bar, with the few numbers worth watching live."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        postfix = {}
        for keys, label in _POSTFIX:
            for key in keys:
                if key in logs:
                    postfix[label] = f"{logs[key]:.4g}"
                    break
        if "train_runtime" in logs:  # the final summary line of the Trainer
            self.training_bar.write(
                f"trained {state.global_step} steps in {logs['train_runtime']:.1f} s, loss {logs.get('train_loss', 0):.4g}"
            )
        self.training_bar.set_postfix(postfix, refresh=True)


class RunSummary(TrainerCallback):
    """Writes `<output_dir>/summary.png` at the end of training (world process zero)."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.log_history:
            path = write_summary(state.log_history, Path(args.output_dir) / "summary.png")
            if path is not None:
                logger.info("run summary: %s", path)


def write_summary(log_history: list[dict], path: Path) -> Path | None:
    """Plot `SUMMARY_CURVES` over optimizer steps; None when no curve has a point."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    curves = []
    for key, title in SUMMARY_CURVES:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        if points:
            curves.append((title, points))
    if not curves:
        return None
    figure, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for axis, (title, points) in zip(axes[0], curves, strict=True):
        steps, values = zip(*points, strict=True)
        axis.plot(steps, values, marker=".", linewidth=1)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
