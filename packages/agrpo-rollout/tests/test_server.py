import asyncio
import dataclasses
import logging

import pytest

from agrpo_rollout import (
    ResponseFormatError,
    RolloutConfig,
    ServerConfigError,
    VLLMClient,
    check_routed_experts,
)


def _probe(config):
    async def go():
        async with VLLMClient(config) as client:
            return await client.probe()

    return asyncio.run(go())


def test_probe_reads_the_servers_limits_and_flags(vllm_server, server_config):
    info = _probe(server_config())
    assert info.model_name == vllm_server.model_name and info.max_model_len == vllm_server.max_model_len
    assert info.kv_cache_tokens > 0 and info.dtype == "torch.float32"
    assert info.max_logprobs == 20 and info.lora_max_loras == 4 and info.lora_max_rank == 8
    assert info.watermark == 0.0, "--watermark (vLLM default 0) is read from /server_info"
    assert not info.scale_out and not info.return_sampling_mask and not info.uses_generate_endpoint
    assert info.initial_concurrency(8) == 8
    assert info.initial_concurrency(10**9) == info.kv_cache_tokens // info.max_model_len


def test_a_kv_cache_smaller_than_the_bound_without_a_watermark_gets_the_flag_recommended(server_config):
    info = _probe(server_config())
    config = RolloutConfig(max_completion_length=16, max_concurrent_rollouts=64)
    small = dataclasses.replace(info, kv_cache_tokens=4 * info.max_model_len)
    (warning,) = small.check(config)
    assert "holds 4 full-length requests" in warning and "--watermark 0.15" in warning, warning
    assert small.initial_concurrency(64) == 4
    reserving = dataclasses.replace(small, watermark=0.15)
    assert reserving.check(config) == [] and reserving.initial_concurrency(64) == 64
    assert dataclasses.replace(small, watermark=None).check(config) == [], "unknown: nothing to say"
    assert info.check(config) == [], "a cache that holds the bound at full length needs no reserve"


def test_missing_flags_are_named(server_config, caplog):
    with pytest.raises(ServerConfigError, match="--max-logprobs 25"):
        _probe(server_config(num_sampler_logprobs=25))
    with pytest.raises(ServerConfigError, match="not served"):
        _probe(server_config(model_name="no-such-adapter"))
    # Without sampling masks a top-k set is read from top_k + 1 processed log-probs: 51 > --max-logprobs 20.
    with pytest.raises(
        ServerConfigError, match="--max-logprobs 51.*--enable-scale-out --return-sampling-mask"
    ):
        _probe(server_config(top_k=50, top_p=0.9))
    with caplog.at_level(logging.WARNING, logger="agrpo_rollout"):
        info = _probe(server_config(top_k=10, top_p=0.9))
    assert not caplog.text, "candidate sets are recovered exactly: nothing to warn about"
    assert info.logprobs_mode == "processed_logprobs"
    assert info.check(RolloutConfig(num_sampler_logprobs=0, max_completion_length=16)) == []


def test_raw_logprobs_are_flagged_only_when_sampling_reshapes_the_distribution(vllm_server, server_config):
    raw = dataclasses.replace(_probe(server_config()), logprobs_mode="raw_logprobs")
    assert (
        raw.check(RolloutConfig(max_completion_length=16)) == []
    )  # temperature 1, no filters: raw == processed
    for reshaping in [dict(temperature=0.7), dict(repetition_penalty=1.1)]:
        [warning] = raw.check(RolloutConfig(max_completion_length=16, **reshaping))
        assert "--logprobs-mode processed_logprobs" in warning
    # Truncated sampling on raw log-probs cannot train (every ratio is off by the kept mass): refused.
    with pytest.raises(ServerConfigError, match="runs --logprobs-mode raw_logprobs.*processed_logprobs"):
        raw.check(RolloutConfig(max_completion_length=16, top_k=10))


@pytest.mark.server
def test_replay_is_refused_at_start_by_a_server_that_returns_no_routes(server_config, routes_proxy):
    """The real CPU server cannot return routes (vLLM refuses --enable-return-routed-experts without Model
    Runner V2), so its refusal is the real one; through `RoutesProxy` (what a GPU server with the flag
    answers) the same check passes, and routes of another model's shape are refused."""
    moe = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 300, "num_experts_per_tok": 2}
    config = server_config(return_routed_experts=True, model_config=moe)
    with pytest.raises(
        ServerConfigError, match="no routed_experts.*--enable-return-routed-experts.*GPU server"
    ):
        check_routed_experts(config)

    async def through_proxy(model_config):
        proxy = routes_proxy()
        async with proxy as url:
            checked = dataclasses.replace(config, vllm_server_base_url=url, model_config=model_config)
            async with VLLMClient(checked) as client:
                await client.probe()
        return proxy.starts

    assert asyncio.run(through_proxy(moe)) == [0], "one probe completion, routes from the first token"
    with pytest.raises(ResponseFormatError, match="has 3 layers x 2 experts per token.*num_hidden_layers=4"):
        asyncio.run(through_proxy({**moe, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="needs return_routed_experts=True"):
        check_routed_experts(server_config())
