"""The client against the real server, through a fault-injecting proxy, and the generate protocol."""

import asyncio
import json
import logging
import subprocess

import numpy as np
import pytest

from agrpo_rollout import (
    RequestRejectedError,
    ResponseFormatError,
    RolloutConfig,
    ServerConfigError,
    ServerUnavailableError,
    VLLMClient,
    decode_generate,
)
from agrpo_rollout.testing import DEFAULT_ENV_DIR


def test_sample_returns_ids_log_probs_and_top_alternatives(server_config):
    async def go():
        async with VLLMClient(server_config(max_completion_length=20)) as client:
            turn = await client.sample([1, 2, 3, 4])
            room = client.server.max_model_len
            full = await client.sample(list(range(1, 10)) * (room // 9 + 1))
            return turn, full, client.completion_body([1], 5)

    turn, full, body = asyncio.run(go())
    assert turn.num_output_tokens == 20 or turn.stopped
    assert turn.prompt_ids.tolist() == [1, 2, 3, 4] and np.all(turn.output_log_probs <= 0)
    assert turn.output_sampler_logprobs.ids.shape == (turn.num_output_tokens, 8)
    assert full.num_output_tokens == 0 and full.finish_reason == "length", (
        "no room under max_model_len: no request"
    )
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"] and body["logprobs"] == 8


def test_top_k_sets_are_read_from_the_processed_log_probs_of_a_server_without_sampling_masks(server_config):
    """The CPU server has no sampling masks; its processed top_k + 1 log-probs hold each token's whole set."""

    async def go():
        config = server_config(max_completion_length=24, top_k=5, top_p=0.8, num_sampler_logprobs=6)
        async with VLLMClient(config) as client:
            return await client.sample([1, 2, 3, 4]), client.completion_body([1], 5)

    turn, body = asyncio.run(go())
    assert body["logprobs"] == 6 and body["top_k"] == 5 and body["top_p"] == 0.8
    assert len(turn.output_sampling_mask) == turn.num_output_tokens > 0
    top = turn.output_sampler_logprobs
    for token, members, logprob, ids, values in zip(
        turn.output_ids, turn.output_sampling_mask, turn.output_log_probs, top.ids, top.logprobs, strict=True
    ):
        assert token in members and 1 <= len(members) < 5, (
            "top-p cuts the near-uniform top 5 of a random model"
        )
        assert set(ids[np.isfinite(values)].tolist()) == set(members.tolist())
        assert np.exp(values[np.isfinite(values)]).sum() == pytest.approx(1.0, abs=1e-4), (
            "the sampler's own law"
        )
        assert logprob == pytest.approx(float(values[ids == token][0]), abs=1e-6)


def test_raw_log_probs_of_truncated_sampling_are_refused_with_the_flag():
    from agrpo_rollout import RolloutConfig, TopLogprobs
    from agrpo_rollout._candidate_set import split_candidate_sets

    config = RolloutConfig(max_completion_length=4, top_k=2, num_sampler_logprobs=1)
    raw = TopLogprobs(ids=[[5, 6, 7], [6, 5, 7]], logprobs=[[-0.5, -1.0, -3.0], [-0.7, -0.9, -2.0]])
    with pytest.raises(ServerConfigError, match="--logprobs-mode processed_logprobs"):
        split_candidate_sets(raw, np.array([5, 6]), config, "http://s")
    processed = TopLogprobs(
        ids=[[6, 5, 7], [6, 9, 2]], logprobs=[[-0.2, -1.7, -np.inf], [0.0, -np.inf, -np.inf]]
    )
    kept, sets = split_candidate_sets(processed, np.array([5, 6]), config, "http://s")
    assert [s.tolist() for s in sets] == [[6, 5], [6]] and kept.ids.tolist() == [[6], [6]]


@pytest.mark.parametrize(("faults", "retries"), [(["500", "500"], 2), (["hang"], 1), (["drop"], 1)])
def test_transient_faults_are_retried_and_counted(fault_proxy, server_config, faults, retries):
    async def go():
        proxy = fault_proxy(faults)
        async with (
            proxy as url,
            VLLMClient(server_config(vllm_server_base_url=url, vllm_server_timeout=1.5)) as client,
        ):
            turn = await client.sample([1, 2, 3])
            return turn, client.retry_total, proxy.seen

    turn, retry_total, seen = asyncio.run(go())
    assert turn.num_output_tokens > 0 and retry_total == retries
    assert seen[-1] == "pass"


def test_persistent_faults_give_up_with_the_url_and_4xx_is_not_retried(
    vllm_server, server_config, fault_proxy
):
    async def go():
        async with fault_proxy(["500"] * 10) as url:
            client = VLLMClient(server_config(vllm_server_base_url=url, vllm_max_retries=2))
            async with client:
                with pytest.raises(ServerUnavailableError, match=r"failed 3 times.*HTTP 500"):
                    await client.sample([1, 2, 3])
        async with VLLMClient(server_config()) as client:
            with pytest.raises(RequestRejectedError) as rejected:
                await client.request(
                    "POST",
                    "/v1/completions",
                    json={"model": vllm_server.model_name, "prompt": [1], "logprobs": 99},
                )
            return rejected.value.status_code, client.retry_total

    assert asyncio.run(go()) == (400, 0)


# Runs in vLLM's own environment: validates our request body with vLLM's GenerateRequest and builds the
# response with vLLM's own serialisation (`ServingTokens._create_tokens_logprobs`) from engine-shaped
# logprob dicts (sampled token first, then ranks 1..N), as `--enable-scale-out --return-sampling-mask` would.
_VLLM_SIDE = r"""
import json, sys
import numpy as np
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensChoice, GenerateTokensResponse
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.logprobs import Logprob
body = json.load(sys.stdin)
request = GenerateRequest.model_validate(body)
sp = request.sampling_params
num = sp.logprobs
rng = np.random.default_rng(0)
tokens, tops, masks, expected = [], [], [], []
for rank in [1, 3, 8, 9, 15]:
    logits = rng.normal(size=64)
    logp = logits - np.log(np.exp(logits).sum())
    order = np.argsort(-logp)
    sampled = int(order[rank - 1])
    entry = {sampled: Logprob(float(logp[sampled]), rank, None)}
    for r in range(1, num + 1):
        entry.setdefault(int(order[r - 1]), Logprob(float(logp[order[r - 1]]), r, None))
    tokens.append(sampled); tops.append(entry); masks.append(sorted(int(t) for t in order[:20]))
    expected.append({"ids": [int(t) for t in order[: num - 1]], "sampled": float(logp[sampled])})
logprobs = ServingTokens._create_tokens_logprobs(None, tokens, tops, num)
choice = GenerateTokensChoice(index=0, token_ids=tokens, logprobs=logprobs, sampling_mask=masks, finish_reason="length")
print(json.dumps({
    "sampling_params": {"max_tokens": sp.max_tokens, "logprobs": sp.logprobs, "top_k": sp.top_k, "top_p": sp.top_p,
                        "detokenize": sp.detokenize, "temperature": sp.temperature},
    "response": GenerateTokensResponse(model=request.model, choices=[choice]).model_dump(mode="json"),
    "expected": expected,
}))
"""


def test_generate_protocol_with_sampling_masks_against_vllms_own_models(server_config):
    """`--enable-scale-out --return-sampling-mask` cannot run on the CPU build, so the token-in/token-out
    path is checked at the protocol level, with vLLM's own pydantic models and serialiser."""
    client = VLLMClient(server_config(top_k=20, top_p=0.9, num_sampler_logprobs=4, model_name="m"))
    body = client.generate_body([1, 2, 3], 7)
    done = subprocess.run(
        [str(DEFAULT_ENV_DIR / "bin" / "python"), "-c", _VLLM_SIDE],
        input=json.dumps(body), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sampling_params"] == {
        "max_tokens": 7,
        "logprobs": 5,
        "top_k": 20,
        "top_p": 0.9,
        "detokenize": False,
        "temperature": 1.0,
    }
    turn = decode_generate(json.dumps(out["response"]).encode(), [1, 2, 3], 4)
    assert turn.output_ids.tolist() == [
        c["token_id"] for c in out["response"]["choices"][0]["logprobs"]["content"]
    ]
    for i, expected in enumerate(out["expected"]):
        assert sorted(turn.output_sampler_logprobs.ids[i].tolist()) == sorted(expected["ids"]), (
            "the top K, as a set"
        )
        assert turn.output_log_probs[i] == pytest.approx(expected["sampled"], abs=1e-6)
        assert turn.output_sampling_mask[i].tolist() == out["response"]["choices"][0]["sampling_mask"][i]


def test_wait_until_ready(server_config):
    from agrpo_rollout.testing import free_port

    async def go():
        async with VLLMClient(server_config()) as client:
            await client.wait_until_ready(timeout_s=5)
        async with VLLMClient(
            server_config(vllm_server_base_url=f"http://127.0.0.1:{free_port()}")
        ) as client:
            with pytest.raises(ServerUnavailableError, match="/health did not answer"):
                await client.wait_until_ready(timeout_s=1.0)

    asyncio.run(go())


def test_a_model_name_template_names_each_requests_policy_version():
    from agrpo_rollout import RolloutConfig
    from agrpo_rollout._client import POLICY_VERSION

    client = VLLMClient(RolloutConfig(model_name="policy-v{version}"))

    async def request_in_group(version: int) -> str:
        POLICY_VERSION.set(version)  # what the loop does when it dispatches a group; its tasks copy it
        task = asyncio.ensure_future(asyncio.sleep(0, result=None))
        await task
        return await asyncio.ensure_future(_model_of(client))

    async def _model_of(c):
        return c.completion_body([1, 2], 4)["model"]

    assert asyncio.run(request_in_group(3)) == "policy-v3"
    assert asyncio.run(request_in_group(7)) == "policy-v7"
    assert VLLMClient(RolloutConfig(model_name="plain")).completion_body([1], 1)["model"] == "plain"


def test_retries_are_logged_at_most_once_per_interval(fault_proxy, server_config, caplog):
    async def go():
        async with (
            fault_proxy(["500", "drop", "500"]) as url,
            VLLMClient(server_config(vllm_server_base_url=url, vllm_max_retries=3)) as client,
        ):
            await client.probe()
            with caplog.at_level(logging.WARNING, logger="agrpo_rollout"):
                turn = await client.sample([1, 2, 3])
            return turn, client.retry_total

    turn, retry_total = asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert turn.num_output_tokens > 0 and retry_total == 3
    assert len(lines) == 1, "three retries within the interval: one line"
    assert "/v1/completions failed (HTTP 500" in lines[0] and "retry 1 of 3" in lines[0]


def test_a_200_that_is_not_json_raises_response_format_error(fault_proxy, server_config):
    async def go():
        async with (
            fault_proxy(["html"]) as url,
            VLLMClient(server_config(vllm_server_base_url=url)) as client,
        ):
            with pytest.raises(ResponseFormatError, match=r"not the JSON of a vLLM completion.*<html>"):
                await client.sample([1, 2, 3])

    asyncio.run(go())


def test_extra_request_fields_cannot_replace_the_clients_own_fields(server_config):
    with pytest.raises(ValueError, match=r"\['logprobs', 'temperature'\].*RolloutConfig fields"):
        server_config(extra_request_fields={"temperature": 0.0, "logprobs": 2, "stop": ["x"]})
    config = server_config(temperature=0.7, extra_request_fields={"stop_token_ids": [0]})
    config.extra_request_fields["logprobs"] = 2  # set after the check: the client's value still wins
    config.extra_request_fields["temperature"] = 0.0

    async def go():
        async with VLLMClient(config) as client:
            await client.probe()
            return (
                client.completion_body([1], 4),
                client.generate_body([1], 4),
                await client.sample([1, 2, 3]),
            )

    body, generate, turn = asyncio.run(go())
    assert (body["logprobs"], body["temperature"], body["stop_token_ids"]) == (8, 0.7, [0])
    assert generate["sampling_params"]["temperature"] == 0.7
    assert turn.output_sampler_logprobs.ids.shape[1] == 8, "the server got logprobs=8, not 2"


def test_a_seeded_config_repeats_its_samples_and_varies_them_per_request(server_config):
    async def draws(seed):
        async with VLLMClient(server_config(seed=seed, max_completion_length=12)) as client:
            await client.probe()
            return [(await client.sample([5, 6, 7])).output_ids.tolist() for _ in range(2)]

    first, again, other = asyncio.run(draws(3)), asyncio.run(draws(3)), asyncio.run(draws(4))
    assert first == again, "same seed: same tokens"
    assert first[0] != first[1] and first != other, "each request draws its own seed"


def test_a_url_that_is_no_vllm_root_fails_at_once(vllm_server, server_config):
    async def go():
        async with VLLMClient(server_config(vllm_server_base_url=f"{vllm_server.url}/api")) as client:
            with pytest.raises(ServerUnavailableError, match=r"/api/health answered 404.*not the root"):
                await client.wait_until_ready(timeout_s=120)  # would wait 120 s before the fix

    asyncio.run(go())
    with pytest.raises(ValueError, match=r"ends in /v1; pass the server's root \(http://h:8000\)"):
        server_config(vllm_server_base_url="http://h:8000/v1/")


def test_requests_ask_for_routes_from_where_the_caller_lacks_them():
    moe = {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}
    client = VLLMClient(RolloutConfig(return_routed_experts=True, model_config=moe))
    assert client.completion_body([1, 2, 3], 4, routes_from=2)["routed_experts_prompt_start"] == 2
    assert client.generate_body([1, 2, 3], 4)["sampling_params"]["routed_experts_prompt_start"] == 0
    assert "routed_experts_prompt_start" not in VLLMClient(RolloutConfig()).completion_body([1], 4), (
        "off: no field"
    )
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        RolloutConfig(extra_request_fields={"routed_experts_prompt_start": 1})
