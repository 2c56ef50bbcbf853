import asyncio

import pytest

from agrpo_rollout._environment import EnvironmentPool


class Counter:
    built = 0

    def __init__(self):
        Counter.built += 1
        self.value = 0

    def reset(self, start=0, **_):
        self.value = start
        return f"Counter starts at {start}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    async def get_reward(self):
        return float(self.value)


class Quiet:
    def reset(self, **_):
        return None

    def shout(self, text: str) -> str:
        """Upper-case a text.

        Args:
            text: The text.
        """
        return text.upper()


def test_instances_are_reset_reused_and_expose_only_tools():
    async def scenario():
        pool = EnvironmentPool(Counter)
        name, env, returned, seconds = await pool.acquire({"start": 4, "prompt": []}, None)
        assert returned == "Counter starts at 4." and seconds >= 0
        box = pool.toolbox(env)
        assert [s["function"]["name"] for s in box.schemas] == ["increment"]
        assert await box.run([{"function": {"name": "increment", "arguments": {"step": 3}}}]) is not None
        assert await pool.reward(env, None) == (7.0, pytest.approx(0, abs=1.0))
        pool.release(name, env)
        again = await pool.acquire({"start": 1}, None)
        return env, again[1]

    Counter.built = 0
    first, second = asyncio.run(scenario())
    assert first is second and Counter.built == 1 and second.value == 1


def test_dict_factories_select_by_the_environment_column():
    pool = EnvironmentPool({"counter": Counter, "quiet": Quiet})
    assert pool.name_for({"environment": "quiet"}) == "quiet"
    with pytest.raises(ValueError, match="environment"):
        pool.name_for({"environment": "missing"})
    env = asyncio.run(pool.acquire({"environment": "quiet"}, None))[1]
    assert [s["function"]["name"] for s in pool.toolbox(env).schemas] == ["shout"]
    assert asyncio.run(pool.reward(env, None)) == (None, 0.0)
