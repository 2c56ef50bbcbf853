"""`PromptLedger`: the fate of every drawn prompt, for epoch counting and the resume position (SPEC F-Q, F-CKPT).

Owns the trainer's view of consumption. A prompt is keyed by (epoch, row_index) in draw order, epochs
counted from the start of the run (a resumed loop's epochs are shifted by the ledger). Its fate:

- done, nothing to train: `filter_prompt` rejected it, or its group was dropped (all rewards equal,
  fewer than two scorable rollouts);
- done, trained: every sample of its kept group was settled and at least one was trained in a finished
  optimizer step;
- lost: every sample was settled but none trained (all dropped as stale), or its group was abandoned as
  `stale` (its LoRA adapter version was unloaded mid-generation): consumed for epoch counting,
  but regenerated after a resume (it was never trained);
- open: drawn (`record_draw`, when the loop dispatches its group), not settled yet. A group that never
  finishes (a stuck request, a stopped run) keeps its prompt open, so a resume regenerates it.

A micro-batch closes when its rows are full, so a group's samples may be trained in two consecutive
optimizer steps. The rule for such a group at a checkpoint: a prompt counts as trained once any of its
samples was trained in a finished step. The resume position records it as done, so a resumed run never
generates it again; the samples of it that the killed run had not trained yet are lost with that run
(the group is trained once, partly), which is what a prompt trained twice would cost the other way round.

`num_consumed` (done + lost) drives `num_train_epochs`; forks never double-count because a prompt is one
key however many samples its group yields. `resume_state()` is the trained position: the first key not
trained, plus the trained (done or partly trained) keys after it, and how many prompts a resumed run must
not draw again, so it neither trains a prompt twice nor skips one (lost prompts are drawn again, so they
are not counted there). Does not know samples' contents, steps or files; thread-safe (the packing thread
settles stale drops).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

Key = tuple[int, int]
"""(epoch, row_index) of a drawn prompt."""


@dataclass(slots=True)
class _Prompt:
    expected: int | None = None
    """Samples of its kept group; None until the group's outcome arrived."""
    settled: int = 0
    trained: int = 0
    finished: bool = False
    """Its fate is settled (done or lost)."""
    done: bool = False
    earlier: bool = False
    """Done before the resume this ledger started from (already in its `prompts_consumed`)."""

    @property
    def kept_at_resume(self) -> bool:
        """A resumed run must not draw it again: done, or some of its samples trained."""
        return self.done or self.trained > 0


class PromptLedger:
    """Which drawn prompts are consumed and trained; `base_epoch` shifts a resumed loop's epochs."""

    def __init__(
        self,
        *,
        base_epoch: int = 0,
        done: set[Key] | None = None,
        num_consumed: int = 0,
        start: Key | None = None,
    ) -> None:
        self.base_epoch = base_epoch
        self.start = start
        """The resume position this ledger started from (None: a fresh run)."""
        self.num_consumed = num_consumed
        """Prompts whose fate is settled (done or lost), over the whole run including before a resume."""
        self.num_trained_prompts = 0
        self._prompts: dict[Key, _Prompt] = {}
        self._lock = threading.Lock()
        self._earlier_consumed = num_consumed
        for key in done or ():
            self._prompts[key] = _Prompt(finished=True, done=True, earlier=True)

    def key(self, epoch: int, row_index: int) -> Key:
        """The run-wide key of a prompt the (possibly resumed) loop reports at `epoch`, `row_index`."""
        return (self.base_epoch + epoch, row_index)

    def record_draw(self, epoch: int, row_index: int) -> None:
        """The loop dispatched the prompt's group: open until its outcome and samples are settled."""
        with self._lock:
            self._prompts.setdefault(self.key(epoch, row_index), _Prompt())

    def record_outcome(self, outcome: Any) -> None:
        """A `GroupOutcome` from the rollout process (filtered, dropped or kept with its sample count)."""
        with self._lock:
            prompt = self._prompts.setdefault(self.key(outcome.epoch, outcome.row_index), _Prompt())
            if not outcome.kept or outcome.num_samples == 0:  # a stale group was never trained: lost
                self._finish(prompt, done=outcome.reason != "stale")
                return
            prompt.expected = outcome.num_samples
            self._maybe_finish(prompt)

    def settle(self, epoch: int, row_index: int, *, trained: bool) -> None:
        """One sample of the prompt left the pipeline: trained in a finished step, or dropped."""
        with self._lock:
            prompt = self._prompts.setdefault(self.key(epoch, row_index), _Prompt())
            prompt.settled += 1
            prompt.trained += trained
            self._maybe_finish(prompt)

    def _maybe_finish(self, prompt: _Prompt) -> None:
        if prompt.expected is not None and prompt.settled >= prompt.expected:
            self._finish(prompt, done=prompt.trained > 0)

    def _finish(self, prompt: _Prompt, *, done: bool) -> None:
        """Count a prompt's fate once; a lost prompt (done=False) stays open for the resume position."""
        if prompt.finished:
            return
        prompt.finished, prompt.done = True, done
        self.num_consumed += 1
        self.num_trained_prompts += prompt.trained > 0

    def resume_state(self) -> dict[str, Any]:
        """The trained position: the first key not trained (None before any draw), the trained keys from it
        on, and the prompts a resumed run must not draw again (everything before the position and those)."""
        with self._lock:
            kept = sorted(k for k, p in self._prompts.items() if p.kept_at_resume)
            open_keys = [k for k, p in self._prompts.items() if not p.kept_at_resume]
            drawn = [k for k, p in self._prompts.items() if not p.earlier]
            # Everything this run drew is trained: resume at the last one it drew, which the resumed loop then
            # skips (not at a later key done before a resume: rows before it may not be drawn yet).
            first = min(open_keys) if open_keys else (max(drawn) if drawn else self.start)
            done_after = [k for k in kept if first is not None and k >= first]
            new = sum(p.kept_at_resume and not p.earlier for p in self._prompts.values())
            return {
                "resume_from": list(first) if first else None,
                "done": [list(k) for k in done_after],
                "prompts_consumed": self._earlier_consumed + new,
            }
