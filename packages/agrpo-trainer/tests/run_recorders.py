"""What a trainer test reads back from a real run: the samples each step trained, the events the rollout
process sent, the pushes and which servers got them, and a server's log-probs for given ids."""

from __future__ import annotations

from collections import Counter

import httpx
import torch
from transformers import TrainerCallback


class StepRecorder(TrainerCallback):
    """The samples each optimizer step trained (read on rank 0 from the trainer, so add it with
    `add_callback`: it must run after the trainer's own step-end work, which sets `last_step_samples`)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.steps = trainer, []
        trainer.add_callback(self)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(list(self.trainer.last_step_samples))


class EventRecorder:
    """Trainer mixin: keeps every event (draw, group outcome, server, metrics) the rollout process sent."""

    events: list

    def _make_sample_source(self, num_processes: int):
        source = super()._make_sample_source(num_processes)
        drain = source.drain_events

        def recorded():
            events = drain()
            self.events.extend(events)
            return events

        source.drain_events = recorded
        return source


class PushRecorder:
    """Trainer mixin: (version, servers that serve it) after every push, the re-syncs brought forward too."""

    pushes: list

    def _push(self):
        metrics = super()._push()
        self.pushes.append((self._policy_sync.version, sorted(self._policy_sync.weight_sync.members)))
        return metrics


def rollout_totals(events: list) -> Counter:
    """The largest value of each running total the rollout process reported."""
    totals: Counter = Counter()
    for kind, metrics in events:
        if kind == "metrics":
            for name, value in metrics.items():
                if name.endswith("_total"):
                    totals[name] = max(totals[name], value)
    return totals


def server_logprobs(url: str, model_name: str, ids: list[int]) -> torch.Tensor:
    """The server's log-prob of each of `ids[1:]` after the ones before it (prompt log-probs, greedy)."""
    body = {"model": model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    rows = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([rows[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([ids])).logits.float().log_softmax(-1)
    return logits[0, :-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
