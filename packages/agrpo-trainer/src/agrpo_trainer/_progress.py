"""What a person watching a run sees live: the progress bar.

Owns `TrainingProgress` (the Trainer's tqdm bar, with reward, KL to the sampler and throughput as its
postfix instead of a printed dict of every metric per step). The end-of-run picture is `_report`'s. Does
not compute metrics; reads the names `_step_metrics` and the rollout process log.
"""

from __future__ import annotations

from transformers.trainer_callback import ProgressCallback

# (log key, label in the bar); the first present key of each entry is shown.
_POSTFIX = (
    (("reward",), "reward"),
    (("kl",), "kl"),
    (("perf/forwarded_tok_s_wall_clock",), "tok/s"),
    (("perf/step_s",), "s/step"),
    (("rollout/concurrency_cap",), "cap"),
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
