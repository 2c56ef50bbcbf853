"""`ServerPause` against the real CPU vLLM server: a server left paused by `POST /pause` (what a trainer killed
mid-sync leaves behind) is named within seconds, with the fix, instead of holding the loop silently; after
`POST /resume` the groups it held finish. The eval CLI says the same: `test_evaluation.py`."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from agrpo_rollout import AsyncRolloutLoop

pytestmark = pytest.mark.server


def _prompts(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(n)]


def length_reward(completions, **_):
    return [float(len(str(c))) + 0.01 * i for i, c in enumerate(completions)]


def _paused_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "is paused" in r.getMessage()
    ]


def test_a_server_left_paused_is_named_within_seconds_and_its_groups_finish_on_resume(
    vllm_server, server_config, tool_tokenizer, caplog
):
    caplog.set_level(logging.INFO, logger="agrpo_rollout")
    url = vllm_server.url
    metrics, outcomes = [], []

    async def go() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
            loop = AsyncRolloutLoop(
                server_config(max_concurrent_rollouts=4), tokenizer=tool_tokenizer, dataset=_prompts(8),
                reward_funcs=length_reward, max_epochs=1,
            )  # fmt: skip
            run = asyncio.create_task(
                loop.run(lambda s: None, on_group=outcomes.append, metrics_sink=metrics.append)
            )
            started = time.monotonic()
            try:
                while not _paused_warnings(caplog) and time.monotonic() - started < 30 and not run.done():
                    await asyncio.sleep(0.1)
                waited = time.monotonic() - started
                assert not run.done() and outcomes == [], "nothing is generated while the server is paused"
                await asyncio.sleep(0.5)  # a metrics push or two during the named pause
            finally:
                (await http.post("/resume")).raise_for_status()
            try:
                await asyncio.wait_for(run, 60)
            finally:
                run.cancel()
            return waited

    waited = asyncio.run(go())
    warnings = _paused_warnings(caplog)
    assert len(warnings) == 1 and waited < 16, (
        waited,
        warnings,
    )  # one per pause, asked at 5 s, warned at 10 s
    assert f"vLLM server {url} is paused" in warnings[0]
    assert "held by /pause (a weight sync in progress, or a trainer killed during one)" in warnings[0]
    assert f"POST {url}/resume serves its weights as they are" in warnings[0]
    assert "resume_from_checkpoint re-syncs it), or restart the server" in warnings[0]
    assert len(outcomes) == 8, "every held group finishes once the server resumes"
    assert any(
        r.levelno == logging.INFO and "generates again after" in r.getMessage() for r in caplog.records
    )
    held = [m["rollout/server_paused_s"] for m in metrics]
    assert max(held) >= 10 and held[-1] == 0.0, held
