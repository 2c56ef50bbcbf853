"""A short soak (`tools/soak.py`, issue 13 point 4) against the test session's real CPU vLLM server: 256
concurrent multi-turn rollouts with a slow async tool, through a fault proxy answering 500, dropping the
connection or stalling on a share of sampling requests, for about a minute. Same invariants as the full
run recorded in docs/reliability.md: every drawn prompt has exactly one outcome and every kept group's
samples all arrive; no asyncio task, thread, file descriptor or child process is left over after a
warm-up round; RSS stays within the bound after warm-up."""

from __future__ import annotations

import pytest

from tools.soak import SoakSettings, run_soak


@pytest.mark.server
def test_a_short_soak_at_256_concurrent_rollouts_leaks_nothing_and_loses_nothing(vllm_server):
    settings = SoakSettings(minutes=0.75, concurrency=256, groups_per_round=48)
    report = run_soak(vllm_server.url, settings)
    assert report.problems == [], report.summary()
    assert report.rounds >= 2 and report.most_in_flight == 256, report.summary()
    assert report.prompts == report.rounds * settings.groups_per_round
    assert report.samples > 0 and report.tool_calls > 0
    assert min(report.faults[f] for f in ("500", "drop", "slow")) > 0 and report.retries > 0, report.summary()
