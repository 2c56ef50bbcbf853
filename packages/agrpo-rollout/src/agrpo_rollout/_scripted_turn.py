"""`scripted_turn`: a real sampled turn followed by tokens a test dictates, for loops whose model cannot yet
write what the test needs (a random tiny model never writes a well-formed tool call).

Owns the one rule that keeps such turns honest: only the real tokens are trainable (mask 1, the server's
log-probs); the dictated tokens and EOS are context (mask 0, log-prob 0, no sampler candidates, no MoE
route: the server never forwarded them). Real
tokens that do not read as letters, digits or spaces are dropped first: a sampled `<`, `{` or tool tag
before the script would change how the script parses.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ._turn import TopLogprobs, TurnRecord

_PLAIN = re.compile(r"[A-Za-z0-9 ]*")


def scripted_turn(tokenizer: Any, real: TurnRecord, script: str) -> TurnRecord:
    """`real`'s plain-text tokens, then `script`'s tokens and EOS as untrained context; finish reason stop."""
    scripted = np.asarray(tokenizer.encode(script, add_special_tokens=False) + [tokenizer.eos_token_id])
    plain = np.array(
        [_PLAIN.fullmatch(tokenizer.decode([int(t)])) is not None for t in real.output_ids], dtype=bool
    ).reshape(-1)
    top, n = real.output_sampler_logprobs, scripted.shape[0]
    return TurnRecord(
        prompt_ids=real.prompt_ids,
        output_ids=np.concatenate([real.output_ids[plain], scripted]),
        output_log_probs=np.concatenate([real.output_log_probs[plain], np.zeros(n, np.float32)]),
        output_mask=np.concatenate([np.ones(int(plain.sum()), bool), np.zeros(n, bool)]),
        output_sampler_logprobs=TopLogprobs(
            ids=np.concatenate([top.ids[plain], np.full((n, top.ids.shape[1]), -1)]),
            logprobs=np.concatenate([top.logprobs[plain], np.full((n, top.ids.shape[1]), -np.inf)]),
        ),
        finish_reason="stop",
        routed_experts=_routes(real, plain, n),
    )


def _routes(real: TurnRecord, plain: np.ndarray, num_scripted: int) -> np.ndarray | None:
    """The real turn's routes at its prompt and kept tokens (as the server reported them), -1 at the script."""
    if real.routed_experts is None:
        return None
    prompt, output = np.split(real.routed_experts, [real.prompt_ids.shape[0]])
    unrouted = np.full((num_scripted, *prompt.shape[1:]), -1, dtype=np.int16)
    return np.concatenate([prompt, output[plain], unrouted])
