import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agrpo_rollout import Toolbox, ToolSetupError

LOG = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    LOG.append(("add", threading.current_thread() is threading.main_thread()))
    return a + b


async def lookup(city: str) -> dict:
    """Look up the weather of a city.

    Args:
        city: The city name.
    """
    await asyncio.sleep(0.01)
    LOG.append(("lookup", threading.current_thread() is threading.main_thread()))
    return {"city": city, "sky": "clear"}


def explode(reason: str) -> str:
    """Always fail.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


def test_schemas_come_from_docstrings():
    box = Toolbox([add, lookup])
    assert [s["function"]["name"] for s in box.schemas] == ["add", "lookup"]
    assert box.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert list(box) == [add, lookup] and len(box) == 2


def test_calls_run_in_emitted_order_sync_off_the_loop_and_failures_become_messages():
    LOG.clear()
    calls = [
        {"function": {"name": "lookup", "arguments": {"city": "Oslo"}}},
        {"function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"function": {"name": "nope", "arguments": {}}},
        {"function": {"name": "explode", "arguments": {"reason": "boom"}}},
    ]
    with ThreadPoolExecutor(2) as pool:
        outcomes = asyncio.run(Toolbox([add, lookup, explode]).run(calls, pool))
    assert LOG == [("lookup", True), ("add", False)], "async on the loop, sync in the pool, in order"
    assert [o.content for o in outcomes[:2]] == ['{"city": "Oslo", "sky": "clear"}', "5"]
    assert outcomes[2].unknown and outcomes[2].failed and "unknown tool 'nope'" in outcomes[2].content
    assert outcomes[3].failed and not outcomes[3].unknown and "RuntimeError: boom" in outcomes[3].content
    assert outcomes[1].as_chat_message() == {"role": "tool", "name": "add", "content": "5"}


def undocumented(x):
    return x


def test_unusable_tools_are_rejected_with_the_fix():
    with pytest.raises(ToolSetupError, match="docstring"):
        Toolbox([undocumented])
    with pytest.raises(ToolSetupError, match="__name__"):
        Toolbox([lambda x: x])
    with pytest.raises(ToolSetupError, match="unique"):
        Toolbox([add, add])
