"""End to end across every library, against the real CPU vLLM server: the main job's smoke path.

Rollouts from the server become samples, samples become prefix-tree rows, and one tree-attention
forward of each row through the same float32 weights must give back the sampler's log-prob of every
trained token. This ties the token bookkeeping of all packages together: a token shifted by one in
rollout, packing or attention shows up here as a large error.
"""

from __future__ import annotations

from tools.smoke import run_smoke

# vLLM's CPU kernels and transformers' eager float32 forward differ by rounding only (seen: ~1e-6).
LOGPROB_TOLERANCE = 1e-4


def test_sampler_logprobs_are_recovered_from_packed_tree_rows(vllm_server, tiny_qwen3_dir):
    report = run_smoke(vllm_server.url, tiny_qwen3_dir, num_generations=4, max_tokens=32)
    assert report.num_samples >= 4 and report.num_loss_terms > 0
    assert report.packing_ratio > 1.2, "groups share their prompt, so packing must forward fewer tokens"
    assert report.max_logprob_error < LOGPROB_TOLERANCE
