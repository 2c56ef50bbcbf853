"""Tests of `agrpo_trainer.rewards`: each reward's values and edges, the reward contract (one value per
completion, unknown columns ignored, pickling), and math-verify run from worker threads."""

from __future__ import annotations

import logging
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from agrpo_trainer import rewards
from agrpo_trainer.rewards import (
    CharacterFractionReward,
    LengthReward,
    accuracy_reward,
    think_format_reward,
)


def _chat(*assistant_texts: str) -> list[dict]:
    """A multi-turn conversational completion whose assistant turns say `assistant_texts` in order."""
    messages: list[dict] = []
    for i, text in enumerate(assistant_texts):
        if i:
            messages.append({"role": "tool", "content": "42"})
        messages.append({"role": "assistant", "content": text})
    return messages


# ---- accuracy_reward ----


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("Adding them gives \\boxed{7}.", "7", 1.0),
        ("Adding them gives \\boxed{8}.", "7", 0.0),
        ("First I thought 3. The answer is \\boxed{7}.", "7", 1.0),
        ("The answer is 7", "7", 1.0),
        ("the answer is 7.", "7", 1.0),
        ("The answer is 6", "7", 0.0),
        ("The answer is 42 apples", "42", 1.0),
        ("So the result is $\\frac{1}{2}$.", "0.5", 1.0),
        ("So the result is $0.5$.", "\\frac{1}{2}", 1.0),
        ("Final answer: 0.5", "1/2", 1.0),
        ("\\boxed{\\dfrac{2}{4}}", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("\\boxed{0.50001}", "1/2", 0.0),
        ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
        ("\\boxed{2}", "2\\sqrt{3}", 0.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
        ("\\boxed{3000}", "3,000", 1.0),
        ("\\boxed{7}", "Adding 3 and 4 gives $\\boxed{7}$.", 1.0),
    ],
)
def test_accuracy_reward_checks_answers_in_several_notations(completion, gold, expected):
    assert accuracy_reward([completion], [gold]) == [expected]


def test_accuracy_reward_reads_the_answer_after_the_reasoning():
    completion = "<think>maybe the answer is 5</think> The answer is \\boxed{4}"
    assert accuracy_reward([completion, completion], ["4", "5"]) == [1.0, 0.0]


def test_accuracy_reward_does_not_score_a_gold_without_an_answer(monkeypatch, caplog):
    monkeypatch.setattr(rewards, "_warned_unparsed_solution", False)
    with caplog.at_level(logging.WARNING, logger="agrpo_trainer.rewards"):
        values = accuracy_reward(["\\boxed{7}"] * 4, ["see the proof", "", None, "7"])
        accuracy_reward(["\\boxed{7}"], ["blue"])
    assert values == [None, None, None, 1.0]
    warnings = [r.getMessage() for r in caplog.records if "finds no answer" in r.getMessage()]
    assert len(warnings) == 1, "the unparseable solution is reported once"
    assert "'see the proof'" in warnings[0]


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "no numbers here at all",
        "\\boxed{",
        "}}}{{{\\boxed{",
        "$$$",
        "\\frac{",
        "\x00\udcff",
        None,
        123,
        [],
        [{"role": "user", "content": "7"}],
        [{"role": "assistant", "content": None}],
        [{"role": "assistant"}],
        ["not a message"],
    ],
)
def test_accuracy_reward_scores_a_malformed_completion_zero(completion):
    assert accuracy_reward([completion], ["7"]) == [0.0]


def test_accuracy_reward_scores_conversational_like_string_completions():
    golds = ["7", "7", "1/2"]
    texts = ["The answer is \\boxed{7}", "The answer is \\boxed{9}", "It is $\\frac{1}{2}$"]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    assert accuracy_reward(conversational, golds) == accuracy_reward(texts, golds) == [1.0, 0.0, 1.0]


def test_accuracy_reward_scores_the_final_assistant_message_of_a_multi_turn_rollout():
    early_right = _chat("The answer is \\boxed{7}", "Actually it is \\boxed{9}")
    late_right = _chat("Let me check with the tool.", "The answer is \\boxed{7}")
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "The answer is \\boxed{7}"}]}]
    assert accuracy_reward([early_right, late_right, parts], ["7"] * 3) == [0.0, 1.0, 1.0]


def test_accuracy_reward_ignores_other_columns():
    values = accuracy_reward(
        prompts=["What is 3 + 4?"],
        completions=["\\boxed{7}"],
        completion_ids=[[1, 2, 3]],
        solution=["7"],
        difficulty=["easy"],
    )
    assert values == [1.0]


def test_accuracy_reward_rejects_columns_of_different_lengths():
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        accuracy_reward(["\\boxed{7}", "\\boxed{7}"], ["7"])


def test_accuracy_reward_runs_in_worker_threads_like_serially():
    golds = ["7", "1/2", "\\frac{3}{4}", "12"]
    completions = ["\\boxed{7}", "The answer is 0.5", "\\boxed{0.7}", "The answer is 12"]
    expected = accuracy_reward(completions, golds)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(accuracy_reward, completions, golds) for _ in range(32)]
        results = [f.result(timeout=300) for f in futures]
    assert expected == [1.0, 1.0, 0.0, 1.0]
    assert all(r == expected for r in results)


def test_a_huge_power_neither_hangs_nor_freezes_the_calling_process():
    # verify() of 9^(9^9) in-thread holds the GIL for minutes; the child's own timeout ends it in ~5 s
    accuracy_reward(["\\boxed{1}"], ["1"])  # a child is up, so start-up is not timed below
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(accuracy_reward, ["\\boxed{9^{9^{9}}}", "\\boxed{7}"], ["7", "7"])
        ticks = [time.perf_counter()]
        while not future.done():
            time.sleep(0.05)
            ticks.append(time.perf_counter())
        assert future.result(timeout=60) == [0.0, 1.0]
    assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 1.0, "the main thread was starved"


def test_a_silent_verifier_is_killed_and_replaced(monkeypatch, caplog):
    accuracy_reward(["\\boxed{1}"], ["1"])
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="agrpo_trainer.rewards"):
        patch.setattr(rewards, "_HARD_TIMEOUT_S", 0.2)
        assert accuracy_reward(["\\boxed{9^{9^{9}}}"], ["7"]) == [0.0]
    assert any("no verdict within" in r.getMessage() for r in caplog.records)
    assert accuracy_reward(["\\boxed{7}"], ["7"]) == [1.0]


# ---- think_format_reward ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>add 3 and 4</think>7", 1.0),
        ("  <think>\nadd 3 and 4\n</think>\n\nThe answer is 7.\n", 1.0),
        ("<think></think>7", 0.0),
        ("<think> \n </think>7", 0.0),
        ("<think>add 3 and 4</think>", 0.0),
        ("<think>add 3 and 4</think>  \n", 0.0),
        ("add 3 and 4</think>7", 0.0),
        ("7<think>add 3 and 4</think>7", 0.0),
        ("<think>add 3 and 4", 0.0),
        ("<think>add <think>3</think> and 4</think>7", 0.0),
        ("<think>a</think>7<think>b</think>7", 0.0),
        ("<think>a</think>7</think>", 0.0),
        ("", 0.0),
    ],
)
def test_think_format_reward(text, expected):
    assert think_format_reward([text]) == [expected]
    assert think_format_reward([[{"role": "assistant", "content": text}]]) == [expected]


def test_think_format_reward_is_linear_on_long_texts():
    text = "<think>" + "x " * 100_000 + "</think>" + " " * 100_000
    start = time.perf_counter()
    assert think_format_reward([text, "<think>" + "x" * 100_000]) == [0.0, 0.0]
    assert time.perf_counter() - start < 1.0


# ---- LengthReward ----


def test_length_reward_peaks_at_the_target_and_falls_linearly():
    reward = LengthReward(target_tokens=10)
    ids = [[0] * n for n in (10, 5, 15, 0, 20, 30)]
    assert reward(completion_ids=ids) == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0]


def test_length_reward_scale():
    reward = LengthReward(target_tokens=10, scale_tokens=40)
    assert reward(completion_ids=[[0] * 30, [0] * 50, [0] * 60]) == [0.5, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs", [{"target_tokens": 0}, {"target_tokens": -3}, {"target_tokens": 5, "scale_tokens": 0}]
)
def test_length_reward_rejects_non_positive_lengths(kwargs):
    with pytest.raises(ValueError, match="> 0"):
        LengthReward(**kwargs)


# ---- CharacterFractionReward ----


def test_character_fraction_reward():
    digits = CharacterFractionReward()
    assert digits(completions=["1234", "12ab", "abcd", "", None]) == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert digits(completions=[_chat("abcd", "12")]) == [1.0]
    assert CharacterFractionReward(chars="ab")(completions=["abcd"]) == [0.5]


def test_character_fraction_reward_rejects_no_chars():
    with pytest.raises(ValueError, match="at least one character"):
        CharacterFractionReward(chars="")


# ---- the reward contract, for every reward ----

ALL_REWARDS = [accuracy_reward, think_format_reward, LengthReward(target_tokens=4), CharacterFractionReward()]


def _name(reward) -> str:
    return getattr(reward, "__name__", type(reward).__name__)


def _contract_call(reward, num: int) -> list:
    return reward(
        prompts=["What is 3 + 4?"] * num,
        completions=["<think>3 + 4</think>\\boxed{7}"] * num,
        completion_ids=[[5, 6, 7]] * num,
        solution=["7"] * num,
        unknown_column=[{"anything": 1}] * num,
    )


@pytest.mark.parametrize("reward", ALL_REWARDS, ids=_name)
@pytest.mark.parametrize("num", [0, 1, 5])
def test_every_reward_returns_one_value_per_completion(reward, num):
    values = _contract_call(reward, num)
    assert len(values) == num
    assert all(v is None or (isinstance(v, float) and 0.0 <= v <= 1.0) for v in values)


@pytest.mark.parametrize("reward", ALL_REWARDS, ids=_name)
def test_every_reward_survives_a_pickle_round_trip(reward):
    restored = pickle.loads(pickle.dumps(reward))
    assert restored == reward
    assert _contract_call(restored, 2) == _contract_call(reward, 2)
