"""The fast decoder against the plain reference, on real server responses and recorded ones."""

import json

import httpx
import numpy as np
import pytest

from agrpo_rollout import ResponseFormatError, decode_completion
from agrpo_rollout._completion_response import SMALL_TOP_LOGPROBS_BYTES, _fast
from tools.bench.rollout_client.__main__ import confident, load_responses


@pytest.fixture(autouse=True)
def bulk_decoder_at_every_size(monkeypatch):
    """The tests' bodies are short; without this they would take the json.loads path for short arrays
    and leave the bulk decoder untested. `test_short_arrays_take_json_loads` checks the switch itself."""
    monkeypatch.setattr("agrpo_rollout._completion_response.SMALL_TOP_LOGPROBS_BYTES", 0)


def _same(raw: bytes, num_top: int = 8) -> None:
    fast = decode_completion(raw, [1, 2], num_top)
    plain = decode_completion(raw, [1, 2], num_top, reference=True)
    assert np.array_equal(fast.output_ids, plain.output_ids)
    assert np.array_equal(fast.output_log_probs, plain.output_log_probs)
    if num_top == 0:
        assert fast.output_sampler_logprobs is None and plain.output_sampler_logprobs is None
        return
    assert np.array_equal(fast.output_sampler_logprobs.ids, plain.output_sampler_logprobs.ids)
    assert np.array_equal(fast.output_sampler_logprobs.logprobs, plain.output_sampler_logprobs.logprobs)
    assert fast.finish_reason == plain.finish_reason


@pytest.mark.parametrize("variant", ["recorded", "confident"])
def test_fast_path_equals_reference_on_recorded_responses(variant):
    for raw in load_responses():
        _same(confident(raw) if variant == "confident" else raw)


def test_fast_path_equals_reference_on_live_responses(vllm_server):
    for temperature, num_top in [(1.0, 8), (0.05, 8), (1.0, 3), (0.7, 1), (1.0, 0)]:
        body = {
            "model": vllm_server.model_name,
            "prompt": [5, 6, 7, 8],
            "max_tokens": 40,
            "logprobs": num_top,
            "temperature": temperature,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        raw = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=60).content
        _same(raw, num_top)
        if num_top == 0:
            continue
        assert _fast(raw, num_top) is not None  # the real server's bytes take the fast path
        turn = decode_completion(raw, [5, 6, 7, 8], num_top)
        top = turn.output_sampler_logprobs
        assert top.ids.shape == (turn.num_output_tokens, num_top) and (top.ids >= 0).all()
        sampled_in_top = top.ids == turn.output_ids[:, None]
        assert np.allclose(
            top.logprobs[sampled_in_top], np.repeat(turn.output_log_probs, sampled_in_top.sum(1))
        )


def test_sampled_token_outside_the_top_k_is_dropped_and_inside_is_kept():
    raw = (
        b'{"choices":[{"token_ids":[9,3],"finish_reason":"stop","logprobs":{"token_logprobs":[-4.5,-0.25],'
        b'"top_logprobs":[{"token_id:9":-4.5,"token_id:1":-0.5,"token_id:2":-1.5},'
        b'{"token_id:3":-0.25,"token_id:4":-2.5e-05}]}}]}'
    )
    for reference in (False, True):
        turn = decode_completion(raw, [0], 2, reference=reference)
        assert turn.output_sampler_logprobs.ids.tolist() == [[1, 2], [3, 4]]
        assert turn.output_sampler_logprobs.logprobs[1, 1] == np.float32(-2.5e-05)
        assert turn.stopped and turn.output_log_probs.tolist() == [-4.5, -0.25]


def test_clamped_minus_inf_and_missing_fields():
    raw = (
        b'{"choices":[{"token_ids":[7],"finish_reason":"length","logprobs":{"token_logprobs":[-0.1],'
        b'"top_logprobs":[{"token_id:7":-0.1,"token_id:8":-9999.0}]}}]}'
    )
    assert np.isneginf(decode_completion(raw, [0], 2).output_sampler_logprobs.logprobs[0, 1])
    with pytest.raises(ResponseFormatError, match="return_token_ids"):
        decode_completion(b'{"choices":[{"text":"hi"}]}', [0], 2)


def _response(rows, token_ids, *, text="hi", other_choices=()):
    """A `/v1/completions` body as vLLM's JSONResponse writes it (`json.dumps`, compact separators)."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": {
            "text_offset": list(range(len(token_ids))),
            "token_logprobs": [next(iter(row.values())) for row in rows],
            "tokens": [f"token_id:{t}" for t in token_ids],
            "top_logprobs": rows,
        },
        "finish_reason": "length",
        "token_ids": token_ids,
    }
    body = {"id": "cmpl-1", "choices": [choice, *other_choices]}
    return json.dumps(body, separators=(",", ":")).encode()


def _random_rows(rng, num_tokens, num_top, values, in_top=0.5):
    rows, token_ids = [], []
    for _ in range(num_tokens):
        ids = rng.choice(200_000, size=num_top + 1, replace=False).tolist()
        sampled = ids[0] if rng.random() > in_top else ids[1 + rng.integers(num_top)]
        row = {f"token_id:{sampled}": values(rng)}
        for token in ids[1:]:
            row.setdefault(f"token_id:{token}", values(rng))
        rows.append(row)
        token_ids.append(sampled)
    return rows, token_ids


_VALUE_KINDS = {
    # what vLLM sends: float32 log-probs as Python floats (repr: 16-17 digits, `e-05` below 1e-4)
    "float32": lambda rng: float(np.float32(-rng.exponential(3.0) * 10.0 ** -rng.integers(0, 12))),
    "clamped": lambda rng: -9999.0 if rng.random() < 0.3 else float(np.float32(-rng.random())),
    "zeros": lambda rng: [0.0, -0.0, -1.0, -9999.0, -0.5][rng.integers(5)],
    "decimal": lambda rng: float(f"-{rng.random():.{rng.integers(1, 18)}f}"),
    "tiny": lambda rng: float(np.float32(-(10.0 ** -rng.uniform(4, 44)))),
}


@pytest.mark.parametrize("kind", sorted(_VALUE_KINDS))
@pytest.mark.parametrize("in_top", [0.0, 0.5, 1.0])
def test_fast_path_takes_and_matches_every_value_form(kind, in_top):
    rng = np.random.default_rng(len(kind) + int(10 * in_top))
    rows, token_ids = _random_rows(rng, 200, 8, _VALUE_KINDS[kind], in_top)
    raw = _response(rows, token_ids)
    assert _fast(raw, 8) is not None
    _same(raw)


@pytest.mark.parametrize(
    "value, fast",
    [
        (b"-1e-05", True),  # no decimal point
        (b"-7", True),  # an integer
        (b"-1.5E-07", True),
        (b"-2.5e-100", True),  # a 3-digit exponent
        (b"-0.00012345678901234567", True),  # 20 fraction digits, 17 significant
        (b"-12345678.5", True),  # 8 integer digits
        (b"-1.5e+02", False),  # positive exponent: plain path
        (b"-0.3333333432674407958984375", False),  # longer than 24 characters: plain path
    ],
)
def test_unusual_numbers_match_the_reference(value, fast):
    raw = (
        b'{"choices":[{"token_ids":[9,3],"finish_reason":"stop","logprobs":{"token_logprobs":[-4.5,-0.25],'
        b'"top_logprobs":[{"token_id:9":-4.5,"token_id:1":' + value + b',"token_id:2":-1.5},'
        b'{"token_id:3":-0.25,"token_id:4":' + value + b"}]}}]}"
    )
    assert (_fast(raw, 2) is not None) == fast
    _same(raw, 2)
    expected = np.float32(float(value)) if float(value) > -9999.0 else -np.inf  # vLLM's floor of -inf
    assert decode_completion(raw, [0], 2).output_sampler_logprobs.logprobs[1, 1] == expected


def test_a_float32_half_way_value_is_rounded_like_python():
    # 18 digits a hair above 1 + 2**-24, half-way between two float32s: Python's float() lands on the
    # half-way double, which float32 rounds to even (1.0), not up; the fast path must not guess
    text = b"-1.00000005960464478"
    raw = _response([{"token_id:1": -0.5, "token_id:2": -2.0}], [1]).replace(b"-2.0", text)
    assert _fast(raw, 2) is None
    _same(raw, 2)
    assert decode_completion(raw, [0], 2).output_sampler_logprobs.logprobs[0, 1] == np.float32(-1.0)
    raw = raw.replace(text, b"-1.00000005960464")  # 15 digits: exact, fast
    assert _fast(raw, 2) is not None
    _same(raw, 2)


def test_rows_with_fewer_than_k_entries_are_padded():
    rows = [
        {"token_id:5": -0.1, "token_id:6": -2.0},
        {"token_id:7": -0.2},
        {"token_id:8": -1.0, "token_id:5": -3.0},
    ]
    raw = _response(rows, [5, 7, 9])  # the last row lists 8 first but 9 was sampled: not vLLM's layout
    assert _fast(raw, 3) is None
    _same(raw, 3)
    raw = _response(rows, [5, 7, 8])
    assert _fast(raw, 3) is not None
    _same(raw, 3)
    top = decode_completion(raw, [0], 3).output_sampler_logprobs
    assert (
        top.ids.tolist() == [[5, 6, -1], [7, -1, -1], [8, 5, -1]] and np.isneginf(top.logprobs[1, 1:]).all()
    )


def test_text_keys_null_rows_and_other_choices_take_the_plain_path():
    row = {"token_id:3": -0.25, "token_id:4": -2.5}
    tricky_text = 'say "top_logprobs":[{"token_id:1":-1.0}] ]'
    raw = _response([row], [3], text=tricky_text)
    assert _fast(raw, 2) is not None
    _same(raw, 2)
    other = json.loads(_response([{"token_id:7": -0.5, "token_id:8": -1.5}], [7]))["choices"][0]
    raw = _response([row], [3], other_choices=(other,))  # two choices: choice 0 is decoded
    assert _fast(raw, 2) is not None
    _same(raw, 2)
    assert decode_completion(raw, [0], 2).output_ids.tolist() == [3]
    text_keys = raw.replace(b'"token_id:3"', b'"hello:3"').replace(b'"token_id:4"', b'"x]"')
    for reference in (False, True):  # text keys (return_tokens_as_token_ids unset) are refused
        with pytest.raises(ValueError, match="invalid literal"):
            decode_completion(text_keys, [0], 2, reference=reference)
    plain = raw.replace(b'{"token_id:3":-0.25,"token_id:4":-2.5}', b"null", 1)
    assert _fast(plain, 2) is None


def test_short_arrays_take_json_loads_and_long_ones_the_bulk_decoder(monkeypatch):
    """The bulk decoder's fixed cost loses to `json.loads` on short tool turns (measured:
    `tools/bench/rollout_client/response_size.py`); both give the reference's arrays."""
    monkeypatch.setattr(
        "agrpo_rollout._completion_response.SMALL_TOP_LOGPROBS_BYTES", SMALL_TOP_LOGPROBS_BYTES
    )
    calls = []
    real = __import__("agrpo_rollout._completion_response", fromlist=["decode_top_logprobs"])
    bulk = real.decode_top_logprobs
    monkeypatch.setattr(real, "decode_top_logprobs", lambda *a: calls.append(1) or bulk(*a))
    rng = np.random.default_rng(3)
    for num_tokens, bulk_used in [(4, False), (16, False), (64, True)]:
        rows, token_ids = _random_rows(rng, num_tokens, 8, _VALUE_KINDS["float32"])
        raw = _response(rows, token_ids)
        calls.clear()
        _same(raw)
        assert bool(calls) == bulk_used, num_tokens


def test_a_body_that_is_not_json_raises_response_format_error():
    for body in (b"<html>Bad gateway</html>", b"", b'{"choices":[{"token_ids":[1,2'):
        for num_top in (0, 8):
            with pytest.raises(ResponseFormatError, match="vLLM"):
                decode_completion(body, [0], num_top)
