"""`log_completions` (`_completions`): samples as prompt/completion text, and the rich table of the window."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from agrpo_attention.testing import build_tokenizer
from agrpo_rollout import RolloutSample
from agrpo_trainer._completions import CompletionLog, completion_rows, completion_table


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _sample(tokenizer, prompt: str, completion: str, reward: float, advantage: float) -> RolloutSample:
    head = tokenizer.encode(prompt, add_special_tokens=False)
    tail = tokenizer.encode(completion, add_special_tokens=False)
    ids = np.asarray(head + tail, dtype=np.int64)
    n = len(tail)
    return RolloutSample(input_ids=ids, trained_mask=np.arange(len(ids)) >= len(head), group_id=0,
                         advantages=np.full(n, advantage, np.float32), sampler_logprobs=np.zeros(n, np.float32),
                         reward=reward, advantage=advantage)  # fmt: skip


def test_a_sample_splits_into_prompt_and_completion_at_its_first_trained_token(tokenizer):
    sample = _sample(tokenizer, "Count to three:", " one two three", 0.75, -0.5)
    (row,) = completion_rows([sample], tokenizer, step=4)
    assert (row.step, row.prompt, row.completion) == (4, "Count to three:", " one two three")
    assert (row.reward, row.advantage) == (0.75, -0.5)


def test_the_log_prints_num_completions_to_print_rows_with_reward_and_advantage(tokenizer):
    samples = [_sample(tokenizer, f"prompt {i}", f" answer {i}", i / 4, i - 1.5) for i in range(4)]
    trainer = SimpleNamespace(processing_class=tokenizer, last_step_samples=samples)
    out = io.StringIO()
    log = CompletionLog(trainer, Console(file=out, width=120))
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    log.on_step_end(None, state, None)
    log.on_log(SimpleNamespace(num_completions_to_print=3), state, None, logs={})
    text = out.getvalue()
    assert "completions" in text and "reward" in text and "advantage" in text
    assert all(f" answer {i}" in text for i in range(3)) and " answer 3" not in text
    assert "+0.5" in text and "-1.5" in text and "0.25" in text
    log.on_log(SimpleNamespace(num_completions_to_print=None), state, None, logs={})
    assert out.getvalue() == text, "the window was printed: nothing until the next step"
    assert completion_table(completion_rows(samples, tokenizer, 1)).row_count == 4
