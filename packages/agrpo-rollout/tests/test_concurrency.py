"""The controller's shared mechanics, the reference's rule (`kv_usage`) and the default `goodput` rule, on
synthetic readings and on the real server's `/metrics`. Throughput is measured by `tools/bench/concurrency`."""

import asyncio

import pytest

from agrpo_rollout import ConcurrencyController, RolloutConfig, ServerLoad, VLLMClient


def _load(kv=0.1, waiting=0, preemptions=0, running=1):
    return ServerLoad(
        running_requests=running,
        waiting_requests=waiting,
        kv_cache_usage=kv,
        preemptions_total=preemptions,
        kv_cache_tokens=4096,
    )


async def _complete(controller, n):
    for _ in range(n):
        await controller.acquire()
        await controller.release()


def test_raises_by_a_quarter_per_caps_worth_of_completions_up_to_the_bound():
    async def go():
        controller = ConcurrencyController(bound=10, initial=4, rule="kv_usage")
        await controller.observe(_load())
        caps = []
        for _ in range(6):
            await _complete(controller, controller.cap)
            caps.append(controller.cap)
        return caps

    assert asyncio.run(go()) == [5, 7, 9, 10, 10, 10]


def test_queued_requests_or_high_usage_hold_the_cap():
    async def go():
        controller = ConcurrencyController(bound=10, initial=4, rule="kv_usage")
        await controller.observe(_load(waiting=2))
        await _complete(controller, 8)
        held = controller.cap
        await controller.observe(_load(kv=0.7))
        await _complete(controller, 8)
        return held, controller.cap

    assert asyncio.run(go()) == (4, 4)


def test_cut_waits_for_the_pool_to_drain_before_cutting_again():
    async def go():
        controller = ConcurrencyController(bound=16, initial=10, rule="kv_usage")
        for _ in range(10):
            await controller.acquire()
        await controller.observe(_load(kv=0.9))
        first = controller.cap
        await controller.observe(_load(kv=0.95))
        held = controller.cap
        blocked = asyncio.ensure_future(controller.acquire())
        await asyncio.sleep(0.01)
        assert not blocked.done(), "new rollouts wait while the pool is over the cap"
        for _ in range(4):
            await controller.release()
        await controller.observe(_load(kv=0.95))
        second = controller.cap
        blocked.cancel()
        return first, held, second

    assert asyncio.run(go()) == (7, 7, 4)


def test_without_metrics_or_a_rule_the_cap_stays_at_the_bound():
    async def go():
        controller = ConcurrencyController(bound=6)
        await controller.observe(None)
        empty = controller.metrics()
        await controller.observe(_load(kv=0.99, preemptions=3))
        return controller.cap, empty, controller.metrics()

    cap, empty, metrics = asyncio.run(go())
    assert empty == {"rollout/concurrency": 0.0, "rollout/concurrency_cap": 6.0}
    assert cap == 6 and metrics["rollout/kv_cache_usage"] == 0.99, "a fixed cap still reports the server"
    with pytest.raises(ValueError, match="concurrency_control='tcp'; use one of"):
        RolloutConfig(concurrency_control="tcp")


def test_preemptions_total_is_a_running_total_since_the_first_reading():
    """It was the count since the previous metrics push, under a `_total` name."""

    async def go():
        controller = ConcurrencyController(bound=6, initial=6)
        seen = []
        for total in (5, 8, 8, 12):
            await controller.observe(_load(preemptions=total, running=20))
            seen.append(controller.metrics()["rollout/vllm_preemptions_total"])
        seen.append(controller.metrics()["rollout/vllm_preemptions_total"])  # a push without a new reading
        return seen

    assert asyncio.run(go()) == [0.0, 3.0, 3.0, 7.0, 7.0]


async def _fill(controller):
    """Take every free slot (the loop keeps the pool full)."""
    while controller.in_flight < controller.cap:
        await controller.acquire()


async def _complete_some(controller, n):
    for _ in range(n):
        await controller.release()
    await _fill(controller)


async def _reading(controller, *, completions=1, **load):
    """Some rollouts complete (their slots refilled), then a `/metrics` reading arrives."""
    await _complete_some(controller, completions)
    await controller.observe(_load(**load))
    return controller.cap


def test_goodput_rule_doubles_until_requests_queue_then_adds_an_eighth_and_cuts_on_preemptions():
    """The reference rule needed a cap's worth of completions per +25% from a start sized for full-length
    requests (2 -> 8 took 21 completions) and stopped at KV usage 0.6 or any waiting request. Now a full
    cache is no reason to stop; preemptions are."""

    async def go():
        controller = ConcurrencyController(bound=64, initial=2)
        await _fill(controller)
        await controller.observe(_load(running=2))
        caps = [controller.cap]
        for _ in range(3):
            caps.append(await _reading(controller, kv=0.97, running=8))
        caps.append(await _reading(controller, kv=0.97, waiting=4, running=12))  # queued: slow start ends
        caps.append(await _reading(controller, completions=4, waiting=4, running=12))  # a quarter cap done
        caps.append(await _reading(controller, completions=4, preemptions=3, running=12))  # 3 > 0.2 x 4
        while controller.in_flight >= controller.cap:  # the cut waits for the pool to drain under it
            await controller.release()
        caps.append(await _reading(controller, completions=4, preemptions=3, running=12))
        return caps

    assert asyncio.run(go()) == [2, 4, 8, 16, 16, 19, 16, 19]


def test_goodput_rule_tolerates_rare_preemptions_and_cache_resets_and_holds_an_unused_cap():
    async def go():
        controller = ConcurrencyController(bound=128, initial=20)
        await _fill(controller)
        await controller.observe(_load(running=20))
        rare = await _reading(controller, completions=20, preemptions=4, running=20)  # 4 <= 0.2 x 20
        await _reading(controller, completions=0, preemptions=4, running=20)  # a quiet reading
        reset = await _reading(controller, preemptions=4 + 16, running=30)  # 16 of 20 at once: a sync's reset
        nothing_done = await _reading(controller, completions=0, preemptions=20, running=30)
        for _ in range(controller.in_flight // 2):
            await controller.release()  # the loop is not filling the cap (e.g. backpressure)
        await controller.observe(_load(preemptions=20, running=10))
        unused = controller.cap
        await controller.observe(_load(preemptions=20 + 10, running=10))  # a jump...
        await controller.observe(_load(preemptions=30 + 10, running=10))  # ...and another: thrashing
        return rare, reset, nothing_done, unused, controller.cap

    assert asyncio.run(go()) == (40, 80, 80, 80, 68)


def test_on_a_server_with_a_watermark_goodput_cuts_only_on_constant_preemption():
    """vLLM's `--watermark` keeps room for running requests to grow, so the preemptions a deep queue causes
    there are the price of a busy server (0.1-0.5 per rollout at up to the best tokens/s, docs/benchmarks.md); one per
    rollout is still thrashing."""

    async def go(watermark):
        controller = ConcurrencyController(bound=128, initial=128, watermark=watermark)
        await _fill(controller)
        await controller.observe(_load(running=12, waiting=100))
        busy = await _reading(controller, completions=20, preemptions=8, running=12, waiting=100)  # 0.4 each
        await _fill(controller)
        thrashing = await _reading(controller, completions=20, preemptions=8 + 24, running=12, waiting=100)
        return busy, thrashing

    assert asyncio.run(go(0.1)) == (128, 108)
    assert asyncio.run(go(0.0))[0] == 108, "without the server's reserve 0.4 per rollout is overload"


@pytest.mark.parametrize("rule", ["kv_usage", "goodput"])
def test_cap_rises_under_light_load_on_the_real_server(server_config, rule):
    """Polls the real `/metrics` while short requests complete; a tiny model never fills the KV cache."""

    async def go():
        config = server_config(max_completion_length=4)
        async with VLLMClient(config) as client:
            await client.probe()
            controller = ConcurrencyController(bound=8, initial=1, rule=rule)
            poller = asyncio.ensure_future(controller.poll(client.load, 0.05))
            caps, peak = [], 0

            async def one():
                nonlocal peak
                try:
                    peak = max(peak, controller.in_flight)
                    assert controller.in_flight <= controller.cap
                    await client.sample([1, 2, 3])
                finally:
                    await controller.release()

            await asyncio.sleep(0.2)
            tasks = []
            for _ in range(40):
                await controller.acquire()
                caps.append(controller.cap)
                tasks.append(asyncio.ensure_future(one()))
            await asyncio.gather(*tasks)
            poller.cancel()
            return caps, peak, controller.metrics()

    caps, peak, metrics = asyncio.run(go())
    assert caps[0] == 1 and caps[-1] == 8 and caps == sorted(caps) and peak <= 8
    assert set(caps) >= ({1, 2, 3, 4, 5, 7, 8} if rule == "kv_usage" else {1, 2, 4, 8})
    assert metrics["rollout/concurrency_cap"] == 8.0 and "rollout/kv_cache_usage" in metrics
