import httpx
import pytest

from agrpo_rollout import ServerLoad

TWO_ENGINES = """
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:num_preemptions_total{engine="1",model_name="m"} 6.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="4096",num_gpu_blocks="256"} 1.0
vllm:cache_config_info{block_size="16",engine="1",kv_cache_size_tokens="None",num_gpu_blocks="128"} 1.0
"""


def test_engines_sum_and_kv_usage_is_the_max():
    load = ServerLoad.from_text(TWO_ENGINES)
    assert (load.running_requests, load.waiting_requests, load.preemptions_total) == (7, 3, 11)
    assert load.kv_cache_usage == 0.75
    assert load.kv_cache_tokens == 4096 + 128 * 16, "kv_cache_size_tokens, else blocks x block size"


def test_no_vllm_metrics_means_none():
    assert ServerLoad.from_text("# HELP python_info x\npython_info 1.0\n") is None


def test_real_server_metrics(vllm_server):
    load = ServerLoad.from_text(httpx.get(f"{vllm_server.url}/metrics", timeout=30).text)
    assert load is not None and load.kv_cache_tokens > 0 and 0.0 <= load.kv_cache_usage <= 1.0


def test_the_process_start_time_is_read_as_the_servers_identity():
    text = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 2.0\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.79616960815e+09\n"
    )
    assert ServerLoad.from_text(text).started_at == pytest.approx(1.79616960815e09)
    assert ServerLoad.from_text(text.split("# TYPE process")[0]).started_at is None
