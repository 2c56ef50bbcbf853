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
path (`json.loads`), which is also the reference the tests compare against. The bulk decoder's ~90
numpy calls cost about 60 us whatever the length, so a `top_logprobs` array under
`SMALL_TOP_LOGPROBS_BYTES` (a short tool turn) is read by `json.loads` of that array alone, which is
faster there. A body that is not JSON raises `ResponseFormatError`. Cost: `tools/bench/rollout_client`.
MoE routes (`routed_experts`, a base64 string in the choice) are decoded only when a caller passes an
`ExpertRouting` (`_routed_experts.py`), in bulk by numpy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import msgspec
import numpy as np

from ._exceptions import ResponseFormatError
from ._routed_experts import ExpertRouting
from ._top_logprobs_json import decode_top_logprobs
from ._turn import TopLogprobs, TurnRecord

_TOKEN_ID_PREFIX = "token_id:"
SMALL_TOP_LOGPROBS_BYTES = 6144
"""A `top_logprobs` array shorter than this (about 20 tokens with 8 log-probs each) is decoded by
`json.loads`: the bulk decoder's ~90 numpy calls cost a fixed ~60 us that `json.loads` only spends
above it (`tools/bench/rollout_client/response_size.py`)."""
_Decoded = tuple[str | None, np.ndarray, np.ndarray, TopLogprobs | None, str | None, str | None]
"""finish_reason, (T,) token ids, (T,) sampled log-probs, top log-probs, routed_experts (base64), response id."""
_TOP_START = b'"top_logprobs":[{'
_FLOATS = msgspec.json.Decoder(list[float])


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: msgspec.Raw = msgspec.Raw(b"null")
    top_logprobs: msgspec.Raw = msgspec.Raw(b"null")


class _CompletionChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None
    routed_experts: str | None = None


class _Completion(msgspec.Struct):
    choices: list[_CompletionChoice]
    id: str | None = None


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
    routed_experts: str | None = None


class _Generate(msgspec.Struct):
    choices: list[_GenerateChoice]
    request_id: str | None = None


_COMPLETION = msgspec.json.Decoder(_Completion)
_GENERATE = msgspec.json.Decoder(_Generate)


def _no_token_ids(raw: bytes) -> ResponseFormatError:
    return ResponseFormatError(
        f"response has no choices[0].token_ids (first bytes: {raw[:200]!r}); the client sends "
        "return_token_ids=true, which needs vLLM >= 0.10"
    )


def _first_choice(choices: Sequence, raw: bytes):
    if not choices or choices[0].token_ids is None:
        raise _no_token_ids(raw)
    return choices[0]


def _floor_to_inf(logprobs: np.ndarray) -> np.ndarray:
    """vLLM clamps -inf to -9999.0 for JSON; restore -inf so padding and masked tokens agree."""
    return np.where(logprobs <= -9999.0, np.float32(-np.inf), logprobs).astype(np.float32, copy=False)


def _fast(raw: bytes, num_top: int):
    """(response id, choice, token ids, sampled log-probs, (T, K) ids, (T, K) log-probs) or None: see the
    module doc."""
    lo = raw.find(_TOP_START) + len(_TOP_START) - 2
    hi = raw.find(b"]", lo)
    if lo < 32 or hi < 0:
        return None
    try:
        envelope = _COMPLETION.decode(raw[:lo] + b"0" + raw[hi + 1 :])
    except msgspec.DecodeError:
        return None
    choices = envelope.choices
    choice = choices[0] if choices else None
    if choice is None or choice.token_ids is None or choice.logprobs is None:
        return None
    if bytes(choice.logprobs.top_logprobs) != b"0":
        return None
    token_ids = np.asarray(choice.token_ids, dtype=np.int64)
    if hi - lo < SMALL_TOP_LOGPROBS_BYTES:
        small = _small_top(raw[lo : hi + 1], choice, token_ids, num_top)
        return None if small is None else (envelope.id, *small)
    decoded = decode_top_logprobs(raw, lo, hi, num_top)
    if decoded is None or decoded[0].shape != token_ids.shape or (decoded[0] != token_ids).any():
        return None
    return envelope.id, choice, token_ids, *decoded[1:]


def _small_top(array: bytes, choice: _CompletionChoice, token_ids: np.ndarray, num_top: int):
    """A short `top_logprobs` array: `json.loads` of it alone beats the bulk decoder's fixed cost."""
    try:
        rows = json.loads(array)
        sampled = np.asarray(_FLOATS.decode(choice.logprobs.token_logprobs), dtype=np.float32)
    except ValueError:  # msgspec.DecodeError too: a `]` in a text key, a null log-prob: the plain path
        return None
    if len(rows) != token_ids.shape[0] or sampled.shape != token_ids.shape:
        return None
    return choice, token_ids, sampled, *_top_arrays(rows, token_ids.shape[0], num_top)


def _top_arrays(rows: list, num_tokens: int, num_top: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, K) ids and log-probs from the `top_logprobs` dicts, one Python dict per token."""
    ids = np.full((num_tokens, num_top), -1, dtype=np.int64)
    values = np.full((num_tokens, num_top), -np.inf, dtype=np.float32)
    for i, row in enumerate(rows):
        items = list((row or {}).items())
        items = items[1:] if len(items) > num_top else items
        for j, (key, value) in enumerate(items):
            ids[i, j] = int(key.removeprefix(_TOKEN_ID_PREFIX))
            values[i, j] = value
    return ids, values


def _not_a_completion(raw: bytes, exc: Exception) -> ResponseFormatError:
    return ResponseFormatError(
        f"response is not the JSON of a vLLM completion ({exc}; first bytes: {raw[:200]!r}); check that the "
        "URL is a vLLM server's root"
    )


def _decode_plain(raw: bytes, num_top: int) -> _Decoded:
    """The reference path: one `json.loads` of the whole body and a dict per token."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _not_a_completion(raw, exc) from exc
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if choice.get("token_ids") is None:
        raise _no_token_ids(raw)
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or logprobs.get("token_logprobs") is None:
        raise ResponseFormatError("response has no logprobs; the request must set logprobs >= 0")
    sampled = np.asarray([np.nan if v is None else v for v in logprobs["token_logprobs"]], dtype=np.float32)
    top = None
    if num_top > 0:
        ids, values = _top_arrays(logprobs.get("top_logprobs") or [], len(sampled), num_top)
        top = TopLogprobs(ids=ids, logprobs=_floor_to_inf(values))
    token_ids = np.asarray(choice["token_ids"], dtype=np.int64)
    return choice.get("finish_reason"), token_ids, sampled, top, choice.get("routed_experts"), body.get("id")


def _decode_fast(raw: bytes, num_top: int) -> _Decoded | None:
    """The fast path (module docstring); None where it does not apply."""
    fast = _fast(raw, num_top)
    if fast is None:
        return None
    response_id, choice, token_ids, sampled, top_ids, top_logprobs = fast
    return (
        choice.finish_reason,
        token_ids,
        sampled,
        TopLogprobs(ids=top_ids, logprobs=_floor_to_inf(top_logprobs)),
        choice.routed_experts,
        response_id,
    )


def _decode_envelope(raw: bytes) -> _Decoded | None:
    """No top log-probs asked: msgspec decodes the envelope and skips `top_logprobs` unparsed; None for a
    null log-prob (the plain path keeps it as NaN)."""
    try:
        envelope = _COMPLETION.decode(raw)
    except msgspec.DecodeError as exc:
        raise _not_a_completion(raw, exc) from exc
    choice = _first_choice(envelope.choices, raw)
    if choice.logprobs is None or bytes(choice.logprobs.token_logprobs) == b"null":
        raise ResponseFormatError("response has no logprobs; the request must set logprobs >= 0")
    try:
        sampled = np.asarray(_FLOATS.decode(choice.logprobs.token_logprobs), dtype=np.float32)
    except msgspec.DecodeError:
        return None
    token_ids = np.asarray(choice.token_ids, dtype=np.int64)
    return choice.finish_reason, token_ids, sampled, None, choice.routed_experts, envelope.id


def _routes(
    routing: ExpertRouting | None,
    encoded: str | None,
    response_id: str | None,
    num_tokens: tuple[int, int],
    finish_reason: str | None,
    routes_from: int,
) -> np.ndarray | None:
    """The per-token routes of one response (`ExpertRouting.decode`), or None when not asked for. A request
    aborted before its first forward (a pause in abort mode) has none to return: every token is unrouted."""
    if routing is None:
        return None
    num_prompt, num_output = num_tokens
    if encoded is None and finish_reason == "abort":
        return routing.unrouted(num_prompt + num_output)
    request = f"response {response_id} (prompt of {num_prompt} tokens, {num_output} sampled)"
    return routing.decode(
        encoded, num_tokens=num_prompt + num_output, prompt_start=routes_from, request=request
    )


def decode_completion(
    raw: bytes,
    prompt_ids: Sequence[int] | np.ndarray,
    num_top: int,
    *,
    reference: bool = False,
    routing: ExpertRouting | None = None,
    routes_from: int = 0,
) -> TurnRecord:
    """Turn a `/v1/completions` response body into a `TurnRecord` (fast path unless `reference`); with
    `routing`, also its MoE routes (the request sent `routed_experts_prompt_start=routes_from`)."""
    decoded = None
    if not reference:
        decoded = _decode_fast(raw, num_top) if num_top > 0 else _decode_envelope(raw)
    finish_reason, token_ids, sampled, top, encoded, response_id = decoded or _decode_plain(raw, num_top)
    sizes = (len(prompt_ids), token_ids.shape[0])
    return TurnRecord(
        prompt_ids=prompt_ids,
        output_ids=token_ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top,
        finish_reason=finish_reason,
        routed_experts=_routes(routing, encoded, response_id, sizes, finish_reason, routes_from),
    )


def decode_generate(
    raw: bytes,
    prompt_ids: Sequence[int] | np.ndarray,
    num_top: int,
    *,
    routing: ExpertRouting | None = None,
    routes_from: int = 0,
) -> TurnRecord:
    """Turn an `/inference/v1/generate` body into a `TurnRecord`, sampling masks included (and MoE routes
    with `routing`, as in `decode_completion`).

    The request asked for `num_top + 1` log-probs; entries are kept by their rank (1..num_top), so the
    sampled token, listed first, is dropped when it is outside the top `num_top`.
    """
    try:
        envelope = _GENERATE.decode(raw)
    except msgspec.DecodeError as exc:
        raise _not_a_completion(raw, exc) from exc
    choice = _first_choice(envelope.choices, raw)
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
        routed_experts=_routes(
            routing,
            choice.routed_experts,
            envelope.request_id,
            (len(prompt_ids), len(choice.token_ids)),
            choice.finish_reason,
            routes_from,
        ),
    )
