"""Decoding vLLM sampling responses into `TurnRecord`s, fast.

Owns the wire shapes of `/v1/completions` (with `return_token_ids` and `return_tokens_as_token_ids`)
and of `/inference/v1/generate`, and their conversion to arrays. Does not know HTTP or retries.

Why this is not `json.loads`: with 8 top log-probs a generated token costs about 350 bytes of JSON,
mostly `{"token_id:343":-6.2199,...}` objects. Building those dicts costs about 5 us per token, which
makes a 2-core rollout process the bottleneck of a large server. The fast path creates no Python
object per token: it finds the `top_logprobs` array with two `bytes.find`s, decodes the rest of the
envelope with msgspec (the array replaced by a `0` marker, which proves it was choice 0's) and the
array itself in bulk (`_top_logprobs_json.py`). vLLM lists the sampled token first in each dict and
adds it as entry K+1 only when it is outside the top K, so a row of K+1 entries drops its first, and
the sampled log-prob is the first entry's (vLLM writes it and `token_logprobs` from the same
`Logprob`); first ids are checked against `token_ids`. Anything unexpected falls back to the plain
path, which is also the reference the tests compare against. Cost: `tools/bench/rollout_client`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec
import numpy as np

from ._exceptions import ResponseFormatError
from ._top_logprobs_json import decode_top_logprobs
from ._turn import TopLogprobs, TurnRecord

_TOKEN_ID_PREFIX = "token_id:"
_TOP_START = b'"top_logprobs":[{'
_FLOATS = msgspec.json.Decoder(list[float])


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: msgspec.Raw = msgspec.Raw(b"null")
    top_logprobs: msgspec.Raw = msgspec.Raw(b"null")


class _CompletionChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Completion(msgspec.Struct):
    choices: list[_CompletionChoice]


class _GenerateLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None


class _GenerateContent(msgspec.Struct):
    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[_GenerateLogprob] = []


class _GenerateLogprobs(msgspec.Struct):
    content: list[_GenerateContent] | None = None


class _GenerateChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _GenerateLogprobs | None = None
    finish_reason: str | None = None
    sampling_mask: list[list[int]] | None = None


class _Generate(msgspec.Struct):
    choices: list[_GenerateChoice]


_COMPLETION = msgspec.json.Decoder(_Completion)
_GENERATE = msgspec.json.Decoder(_Generate)


def _first_choice(choices: Sequence, raw: bytes):
    if not choices or choices[0].token_ids is None:
        raise ResponseFormatError(
            f"response has no choices[0].token_ids (first bytes: {raw[:200]!r}); the client sends "
            "return_token_ids=true, which needs vLLM >= 0.10"
        )
    return choices[0]


def _floor_to_inf(logprobs: np.ndarray) -> np.ndarray:
    """vLLM clamps -inf to -9999.0 for JSON; restore -inf so padding and masked tokens agree."""
    return np.where(logprobs <= -9999.0, np.float32(-np.inf), logprobs).astype(np.float32, copy=False)


def _fast(raw: bytes, num_top: int):
    """(choice, token ids, sampled log-probs, (T, K) ids, (T, K) log-probs) or None: see the module doc."""
    lo = raw.find(_TOP_START) + len(_TOP_START) - 2
    hi = raw.find(b"]", lo)
    if lo < 32 or hi < 0:
        return None
    try:
        choices = _COMPLETION.decode(raw[:lo] + b"0" + raw[hi + 1 :]).choices
    except msgspec.DecodeError:
        return None
    choice = choices[0] if choices else None
    if choice is None or choice.token_ids is None or choice.logprobs is None:
        return None
    if bytes(choice.logprobs.top_logprobs) != b"0":
        return None
    decoded = decode_top_logprobs(raw, lo, hi, num_top)
    token_ids = np.asarray(choice.token_ids, dtype=np.int64)
    if decoded is None or decoded[0].shape != token_ids.shape or (decoded[0] != token_ids).any():
        return None
    return choice, token_ids, *decoded[1:]


def _plain_top(raw: bytes, num_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference path: `json.loads` and one dict per token."""
    logprobs = json.loads(raw)["choices"][0]["logprobs"]
    sampled = np.asarray([np.nan if v is None else v for v in logprobs["token_logprobs"]], dtype=np.float32)
    rows = logprobs["top_logprobs"] or []
    ids = np.full((len(sampled), num_top), -1, dtype=np.int64)
    values = np.full((len(sampled), num_top), -np.inf, dtype=np.float32)
    for i, row in enumerate(rows):
        items = list((row or {}).items())
        items = items[1:] if len(items) > num_top else items
        for j, (key, value) in enumerate(items):
            ids[i, j] = int(key.removeprefix(_TOKEN_ID_PREFIX))
            values[i, j] = value
    return sampled, ids, values


def _sampled_logprobs(raw_list: msgspec.Raw) -> np.ndarray | None:
    try:
        return np.asarray(_FLOATS.decode(raw_list), dtype=np.float32)
    except msgspec.DecodeError:  # a null log-prob: leave it to the plain path
        return None


def decode_completion(
    raw: bytes, prompt_ids: Sequence[int] | np.ndarray, num_top: int, *, reference: bool = False
) -> TurnRecord:
    """Turn a `/v1/completions` response body into a `TurnRecord` (fast path unless `reference`)."""
    fast = None if reference or num_top <= 0 else _fast(raw, num_top)
    if fast is not None:
        choice, token_ids, sampled, top_ids, top_logprobs = fast
        top = TopLogprobs(ids=top_ids, logprobs=_floor_to_inf(top_logprobs))
    else:
        choice, token_ids, sampled, top = _decode_plain(raw, num_top, reference)
    return TurnRecord(
        prompt_ids=prompt_ids,
        output_ids=token_ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top,
        finish_reason=choice.finish_reason,
    )


def _decode_plain(raw: bytes, num_top: int, reference: bool):
    """The general path: msgspec for the envelope, `json`-style decoding of the top log-probs."""
    choice = _first_choice(_COMPLETION.decode(raw).choices, raw)
    token_ids = np.asarray(choice.token_ids, dtype=np.int64)
    if choice.logprobs is None or bytes(choice.logprobs.token_logprobs) == b"null":
        raise ResponseFormatError("response has no logprobs; the request must set logprobs >= 0")
    sampled = None if reference else _sampled_logprobs(choice.logprobs.token_logprobs)
    decoded = None
    if sampled is None or num_top > 0:
        sampled, *decoded = _plain_top(raw, num_top)
    top = None
    if num_top > 0:
        top = TopLogprobs(ids=decoded[0], logprobs=_floor_to_inf(decoded[1]))
    return choice, token_ids, sampled, top


def decode_generate(raw: bytes, prompt_ids: Sequence[int] | np.ndarray, num_top: int) -> TurnRecord:
    """Turn an `/inference/v1/generate` body into a `TurnRecord`, sampling masks included.

    The request asked for `num_top + 1` log-probs; entries are kept by their rank (1..num_top), so the
    sampled token, listed first, is dropped when it is outside the top `num_top`.
    """
    choice = _first_choice(_GENERATE.decode(raw).choices, raw)
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None or len(content) != len(choice.token_ids):
        raise ResponseFormatError(
            "generate response has no per-token logprobs; send sampling_params.logprobs"
        )
    sampled = np.fromiter((c.logprob for c in content), np.float32, len(content))
    top = None
    if num_top > 0:
        ids = np.full((len(content), num_top), -1, dtype=np.int64)
        values = np.full((len(content), num_top), -np.inf, dtype=np.float32)
        for i, entry in enumerate(content):
            kept = [c for c in entry.top_logprobs if c.rank is not None and 1 <= c.rank <= num_top]
            for j, candidate in enumerate(kept[:num_top]):
                ids[i, j], values[i, j] = candidate.token_id, candidate.logprob
        top = TopLogprobs(ids=ids, logprobs=_floor_to_inf(values))
    return TurnRecord(
        prompt_ids=prompt_ids,
        output_ids=choice.token_ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top,
        output_sampling_mask=choice.sampling_mask,
        finish_reason=choice.finish_reason,
    )
