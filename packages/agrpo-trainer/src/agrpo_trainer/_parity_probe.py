"""`ParityProbe`: after a weight sync, does the server score a fixed text as the trainer's weights do?

Owns the post-sync parity check (SPEC F-BEYOND): a fixed probe of `num_tokens` tokens is scored on the
server (`/v1/completions` with `prompt_logprobs`, temperature 1, so the log-probs are the raw model's)
and by the trainer's model (one unshared row through tree attention, no autocast: the weights the server
was sent), and `sync/logprob_max_abs_diff` is the largest gap over the probe's tokens. A silent sync
failure (weights that did not land, a server that restarted on other weights) shows as a gap of nats; a
dtype difference between the two sides as a small one (about 1e-5 in fp32 on both sides, up to ~0.1-0.5
with a bf16 server). Every rank must call `trainer_logprobs` (sharded models gather in the forward); only
rank 0 talks to the server. Does not know when syncs happen nor what to do about a gap (the trainer warns).
"""

from __future__ import annotations

import httpx
import numpy as np
import torch

from agrpo_attention import token_logprobs
from agrpo_packing import PackSample, TreeRow

_PROBE_TEXT = (
    "The committee met on a cold morning to compare the two proposals. After an hour of careful reading, "
    "they agreed that the second one explained its costs more clearly, and asked for a revised budget. "
)


def probe_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """A fixed natural-text probe of exactly `num_tokens` token ids (the text repeats as needed)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(tokenizer.encode(_PROBE_TEXT, add_special_tokens=False))
    return ids[:num_tokens]


class ParityProbe:
    """Scores `token_ids` on the server and with the trainer's model."""

    def __init__(self, base_url: str, token_ids: list[int], *, timeout_s: float = 60.0) -> None:
        if len(token_ids) < 2:
            raise ValueError("the parity probe needs at least 2 tokens (the first has no log-prob)")
        self.base_url = base_url.rstrip("/")
        self.token_ids = [int(t) for t in token_ids]
        self.timeout_s = timeout_s

    def server_logprobs(self, model_name: str) -> np.ndarray:
        """(n - 1,) log-probs the server gives tokens 1..n-1 of the probe under `model_name`."""
        body = {
            "model": model_name,
            "prompt": self.token_ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        with httpx.Client(timeout=self.timeout_s) as client:
            response = client.post(f"{self.base_url}/v1/completions", json=body)
        response.raise_for_status()
        entries = response.json()["choices"][0]["prompt_logprobs"][1:]
        out = np.empty(len(entries), dtype=np.float64)
        for i, (token, entry) in enumerate(zip(self.token_ids[1:], entries, strict=True)):
            out[i] = _logprob_of(entry, token)
        return out

    @torch.no_grad()
    def trainer_logprobs(self, model: torch.nn.Module) -> np.ndarray:
        """(n - 1,) log-probs the trainer's tree-enabled model gives the same tokens, without autocast."""
        row = TreeRow(0)
        n = len(self.token_ids)
        row.add(
            PackSample(
                input_ids=self.token_ids,
                trained_mask=[False] + [True] * (n - 1),
                group_id=0,
                advantages=np.zeros(n - 1),
                sampler_logprobs=np.zeros(n - 1),
            )
        )
        was_training = model.training
        model.eval()
        try:
            device_type = next(model.parameters()).device.type
            with torch.autocast(device_type=device_type, enabled=False):
                values = token_logprobs(model, row.pack())
        finally:
            model.train(was_training)
        return values.double().cpu().numpy()


def _logprob_of(entry: dict, token: int) -> float:
    """The log-prob of `token` in one `prompt_logprobs` entry (keys are ids, or `token_id:N` strings)."""
    for key, value in entry.items():
        if str(key).removeprefix("token_id:") == str(token):
            return float(value["logprob"] if isinstance(value, dict) else value)
    raise ValueError(f"prompt_logprobs entry has no log-prob for token {token}: keys {list(entry)[:5]}")
