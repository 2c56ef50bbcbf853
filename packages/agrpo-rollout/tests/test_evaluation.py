import json

import pytest

from agrpo_rollout.__main__ import main
from agrpo_rollout._evaluation import _report, exact_match, extract_answer, load_eval_dataset, resolve_reward


def test_builtin_rewards_and_pass_at_k():
    completions = [[{"role": "assistant", "content": "so <answer> 4 </answer>"}], "4", "5"]
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert exact_match(completions, answer=["4", "4", "4"]) == [1.0, 1.0, 0.0]
    assert exact_match(completions) == [None, None, None]
    assert resolve_reward("agrpo_rollout._evaluation:contains_answer").__name__ == "contains_answer"
    with pytest.raises(ValueError, match="module:function"):
        resolve_reward("nope")
    records = [
        {"row_index": 0, "reward": 1.0, "num_tokens": 3},
        {"row_index": 0, "reward": 0.0, "num_tokens": 3},
        {"row_index": 1, "reward": None, "num_tokens": 4},
        {"row_index": 1, "reward": 0.0, "num_tokens": 0},
    ]
    report = _report(records, 2, 1.0, wall_s=2.0)
    assert (report.pass_at_1, report.pass_at_k, report.mean_reward, report.tokens_per_s) == (
        0.25,
        0.5,
        1 / 3,
        5.0,
    )


def test_eval_cli_on_a_jsonl_file(vllm_server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(3))
    )
    out = tmp_path / "completions.jsonl"
    code = main([
        "eval", "--base-url", vllm_server.url, "--model", vllm_server.model_name, "--dataset", str(data),
        "--prompt-column", "question", "--reward", "exact", "--reward", "contains", "--num-generations", "3",
        "--max-completion-length", "8", "--output", str(out), "--no-progress",
    ])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_prompts"] == 3 and report["num_rollouts"] == 9 and report["k"] == 3
    assert 0.0 <= report["pass_at_1"] <= report["pass_at_k"] <= 1.0 and report["tokens_per_s"] > 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 9 and {line["row_index"] for line in lines} == {0, 1, 2}
    assert lines[0]["prompt"][0]["role"] == "user" and set(lines[0]["rewards"]) == {
        "exact_match",
        "contains_answer",
    }


def test_reasoning_gym_tasks_load_and_score_with_their_own_scorer():
    from agrpo_rollout._evaluation import gym_score

    rows = load_eval_dataset("basic_arithmetic", num_prompts=3, seed=1)
    assert len(rows) == 3 and rows[0]["prompt"][0]["role"] == "user"
    right = [[{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}] for r in rows]
    assert gym_score(right, entry=[r["entry"] for r in rows]) == [1.0, 1.0, 1.0]
    assert gym_score(["nonsense"] * 3, entry=[r["entry"] for r in rows]) == [0.0, 0.0, 0.0]
