"""`ParityProbe`: after a weight sync, does the server score tokens as the trainer's weights do?

Owns the post-sync parity check (SPEC F-BEYOND): the server continues a fixed prompt for about three
quarters of `num_tokens` tokens (`/v1/completions`, temperature 1, `ignore_eos`, so the sampled tokens'
log-probs are the raw model's), and the trainer's model scores the same prompt + continuation (one
unshared row through tree attention, no autocast: the weights the server was sent);
`sync/logprob_max_abs_diff` is the largest gap over the continuation. A silent sync failure (weights that
did not land, a server that restarted on other weights) shows as a gap of nats; a dtype difference as a
small one (about 1e-5 in fp32 on both sides, up to ~0.1-0.5 with a bf16 server). Sampled-token
log-probs, not `prompt_logprobs`: the latter crashes vLLM's engine when a LoRA request asks for them in a
batch with other requests (vLLM issue 29955, seen on 0.32 CPU), and sampled log-probs are the very ones
the sampler hands the trainer. A per-call `cache_salt` keeps the prompt off KV cached under older
weights. Only rank 0 talks to the server; every rank scores (sharded models gather in the forward). Does
not know when syncs happen nor what to do about a gap (the trainer warns).
"""

from __future__ import annotations

import os
import time

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


_PROBE_ATTEMPTS = 6
"""Tries of the probe's request (backoff 0.5, 1, 2, 4, 8 s) before it fails naming the setting that skips it."""


class ParityProbe:
    """Samples a continuation of a fixed prompt on the server and scores it with the trainer's model."""

    def __init__(self, base_url: str, token_ids: list[int], *, timeout_s: float = 60.0) -> None:
        if len(token_ids) < 2:
            raise ValueError("the parity probe needs at least 2 tokens (a prompt token and one to sample)")
        self.base_url = base_url.rstrip("/")
        self.prompt_ids = [int(t) for t in token_ids[: max(1, len(token_ids) // 4)]]
        self.num_sampled = len(token_ids) - len(self.prompt_ids)
        self.timeout_s = timeout_s
        self._calls = 0

    def server_sample(self, model_name: str) -> tuple[list[int], np.ndarray]:
        """(continuation ids, their (k,) log-probs) as the server samples them under `model_name`."""
        self._calls += 1
        body = {
            "model": model_name,
            "prompt": self.prompt_ids,
            "max_tokens": self.num_sampled,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            "cache_salt": f"agrpo-parity-{os.getpid()}-{self._calls}",
        }
        last = ""
        with httpx.Client(timeout=self.timeout_s) as client:
            for attempt in range(_PROBE_ATTEMPTS):
                if attempt:  # a transient 5xx or dropped connection must not end training over a diagnostic
                    time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
                try:
                    response = client.post(f"{self.base_url}/v1/completions", json=body)
                except httpx.TransportError as error:
                    last = f"{type(error).__name__}: {error}"
                    continue
                if response.status_code < 500:
                    break
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                raise RuntimeError(
                    f"the parity probe's request to {self.base_url}/v1/completions failed {_PROBE_ATTEMPTS} times "
                    f"(last: {last}); check the server, or set sync_parity_probe_tokens=0 to skip the probe"
                )
        response.raise_for_status()
        choice = response.json()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        return ids, np.asarray(choice["logprobs"]["token_logprobs"][: len(ids)], dtype=np.float64)

    @torch.no_grad()
    def trainer_logprobs(self, model: torch.nn.Module, continuation: list[int]) -> np.ndarray:
        """(k,) log-probs the trainer's tree-enabled model gives `continuation` after the prompt, no autocast."""
        row = TreeRow(0)
        ids = self.prompt_ids + list(continuation)
        n, k = len(ids), len(continuation)
        row.add(
            PackSample(
                input_ids=ids,
                trained_mask=[False] * (n - k) + [True] * k,
                group_id=0,
                advantages=np.zeros(k),
                sampler_logprobs=np.zeros(k),
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
