import asyncio

from agrpo_rollout import ConcurrencyController, ServerLoad, VLLMClient


def _load(kv=0.1, waiting=0, preemptions=0):
    return ServerLoad(
        running_requests=1,
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
        controller = ConcurrencyController(bound=10, initial=4)
        await controller.observe(_load())
        caps = []
        for _ in range(6):
            await _complete(controller, controller.cap)
            caps.append(controller.cap)
        return caps

    assert asyncio.run(go()) == [5, 7, 9, 10, 10, 10]


def test_queued_requests_or_high_usage_hold_the_cap():
    async def go():
        controller = ConcurrencyController(bound=10, initial=4)
        await controller.observe(_load(waiting=2))
        await _complete(controller, 8)
        held = controller.cap
        await controller.observe(_load(kv=0.7))
        await _complete(controller, 8)
        return held, controller.cap

    assert asyncio.run(go()) == (4, 4)


def test_cut_waits_for_the_pool_to_drain_before_cutting_again():
    async def go():
        controller = ConcurrencyController(bound=16, initial=10)
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


def test_without_metrics_the_cap_stays_at_the_bound():
    async def go():
        controller = ConcurrencyController(bound=6)
        await controller.observe(_load(kv=0.99))
        await controller.observe(None)
        return controller.cap, controller.metrics()

    cap, metrics = asyncio.run(go())
    assert cap == 6 and metrics == {"rollout/concurrency": 0.0, "rollout/concurrency_cap": 6.0}


def test_cap_rises_under_light_load_on_the_real_server(server_config):
    """Polls the real `/metrics` while short requests complete; a tiny model never fills the KV cache."""

    async def go():
        config = server_config(max_completion_length=4)
        async with VLLMClient(config) as client:
            await client.probe()
            controller = ConcurrencyController(bound=8, initial=1)
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
    assert caps[0] == 1 and caps[-1] == 8 and caps == sorted(caps)
    assert set(caps) >= {1, 2, 3, 4, 5, 7, 8} and peak <= 8
    assert metrics["rollout/concurrency_cap"] == 8.0 and "rollout/kv_cache_usage" in metrics
