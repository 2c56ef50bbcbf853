import asyncio
import contextlib
import json
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from agrpo_rollout import ServerUnavailableError
from agrpo_rollout.__main__ import _parser, main, tokenizer_source
from agrpo_rollout._eval_dataset import fit_context, load_eval_dataset, prompt_length
from agrpo_rollout._evaluation import _report, evaluate, exact_match, extract_answer, resolve_reward
from agrpo_rollout.testing import free_port


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


def _write_rows(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_eval_cli_on_a_jsonl_file(vllm_server, tmp_path, capsys, monkeypatch):
    """Also: malformed rows skipped and counted by flag, a reward module found in the current directory
    (the console script does not put it on sys.path), and `--seed` repeating the run."""
    questions = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    data = _write_rows(
        tmp_path / "prompts.jsonl", questions[:2], ['{"question": "broken', '{"q": "no column"}']
    )
    data.write_text(data.read_text() + json.dumps(questions[2]) + "\n")
    (tmp_path / "my_rewards.py").write_text(
        "def always_one(completions, **_):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    runs = []
    for out in ("a.jsonl", "b.jsonl"):
        code = main([
            "eval", "--base-url", vllm_server.url, "--model", vllm_server.model_name, "--dataset", str(data),
            "--prompt-column", "question", "--reward", "exact", "--reward", "my_rewards:always_one",
            "--num-generations", "3", "--max-completion-length", "8", "--output", out, "--no-progress",
            "--skip-bad-rows", "--seed", "11",
        ])  # fmt: skip
        assert code == 0
        runs.append([json.loads(line) for line in (tmp_path / out).read_text().splitlines()])
    printed = capsys.readouterr().out.strip().splitlines()
    assert (
        printed[0].startswith("skipped 2 malformed rows") and "prompts.jsonl:3: not valid JSON" in printed[0]
    )
    report = json.loads(printed[-1])
    assert report["num_prompts"] == 3 and report["num_rollouts"] == 9 and report["k"] == 3
    assert report["skipped_rows"] == 2 and report["pass_at_k"] == 1.0, "always_one passes every rollout"
    assert 0.0 <= report["pass_at_1"] <= report["pass_at_k"] <= 1.0 and report["tokens_per_s"] > 0
    lines = runs[0]
    assert len(lines) == 9 and {line["row_index"] for line in lines} == {0, 1, 2}
    assert lines[0]["prompt"][0]["role"] == "user" and set(lines[0]["rewards"]) == {
        "exact_match",
        "always_one",
    }
    completions = [
        sorted((r["row_index"], r["generation"], str(r["completion"])) for r in run) for run in runs
    ]
    assert completions[0] == completions[1], "--seed repeats the run"
    assert len({c[2] for c in completions[0] if c[0] == 0}) > 1, "the rollouts of a prompt still differ"


def _cli_user_errors(tmp_path) -> dict:
    """Runs `main` on user errors in a fresh interpreter: the exit code, stderr, and whether transformers
    or datasets were imported by then."""
    good = _write_rows(tmp_path / "good.jsonl", [{"prompt": "hi", "answer": "1"}])
    (tmp_path / "empty.jsonl").write_text("")
    bad = _write_rows(tmp_path / "bad.jsonl", [{"prompt": "hi", "answer": "1"}], ["{not json"])
    solution = _write_rows(tmp_path / "solution.jsonl", [{"prompt": "hi", "solution": "4"}])
    base = ["eval", "--model", "m", "--reward", "exact"]
    cases = {
        "top_p": [*base, "--dataset", str(good), "--top-p", "0.9"],
        "reward": ["eval", "--model", "m", "--dataset", str(good), "--reward", "nope"],
        "module": ["eval", "--model", "m", "--dataset", str(good), "--reward", "no_such_module_xyz:fn"],
        "v1": [*base, "--dataset", str(good), "--base-url", "http://localhost:8000/v1"],
        "empty": [*base, "--dataset", str(tmp_path / "empty.jsonl")],
        "bad_json": [*base, "--dataset", str(bad)],
        "answer": [*base, "--dataset", str(solution)],
        "gym_file": ["eval", "--model", "m", "--dataset", str(good), "--reward", "gym"],
    }
    code = f"""
import contextlib, io, json, sys
from agrpo_rollout.__main__ import main
out = {{}}
for name, argv in {cases!r}.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out[name] = [code, err.getvalue(), [m for m in ("transformers", "datasets") if m in sys.modules]]
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_user_errors_are_one_line_each_and_come_before_the_heavy_imports(tmp_path):
    results = _cli_user_errors(tmp_path)
    expected = {
        "top_p": "--top-p=0.9 needs --top-k > 0",
        "reward": "--reward 'nope': use one of",
        "module": "no module 'no_such_module_xyz' in the current directory",
        "v1": "ends in /v1; pass the server's root (http://localhost:8000)",
        "empty": "has no usable rows: it is empty",
        "bad_json": "bad.jsonl:2: not valid JSON",
        "answer": "solution.jsonl:1: no 'answer' column (it has ['prompt', 'solution']), which --reward exact "
        "compares completions with; pass --answer-column naming it",
        "gym_file": "--reward gym scores reasoning-gym tasks with their own scorer; pass a task name as --dataset",
    }
    for name, (code, stderr, heavy) in results.items():
        assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("agrpo-rollout eval: error: "), (
            name
        )
        assert expected[name] in stderr, (name, stderr)
        assert heavy == [], f"{name}: reported after importing {heavy}"
    assert "--skip-bad-rows" in results["bad_json"][1]


def test_a_wrong_url_fails_fast_naming_the_flags(vllm_server, tmp_path, capsys):
    data = _write_rows(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}])
    base = ["eval", "--model", vllm_server.model_name, "--dataset", str(data), "--reward", "exact"]
    assert main([*base, "--base-url", f"http://127.0.0.1:{free_port()}", "--server-timeout", "1"]) == 2
    refused = capsys.readouterr().err
    assert main([*base, "--base-url", f"{vllm_server.url}/api"]) == 2  # the real server answers 404
    wrong_path = capsys.readouterr().err
    assert "check --base-url" in refused and "raise --server-timeout" in refused
    assert "/api/health answered 404" in wrong_path and wrong_path.count("\n") == 1


def _save_lora_adapter(model_dir, out_dir):
    """A rank-1 all-zero PEFT adapter on every q_proj of the tiny model (what vLLM needs to load one)."""
    from safetensors.numpy import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = np.zeros((1, hidden), np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.zeros((heads * head_dim, 1), np.float32)
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"], "bias": "none",
            "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir)}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(peft))
    return out_dir


def test_a_served_name_that_is_no_tokenizer_fails_at_once_naming_tokenizer(
    vllm_server, tiny_qwen3_dir, tmp_path, capsys
):
    """Without --tokenizer the CLI loaded `--model` with transformers: for a LoRA adapter's name that meant
    a hub lookup (55 s of retries offline) and a library traceback."""
    adapter = _save_lora_adapter(tiny_qwen3_dir, tmp_path / "adapter")
    data = _write_rows(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}])
    loaded = httpx.post(f"{vllm_server.url}/v1/load_lora_adapter", json={"lora_name": "eval-alias", "lora_path": str(adapter)}, timeout=120)  # fmt: skip
    assert loaded.status_code == 200, loaded.text
    try:
        argv = ["eval", "--base-url", vllm_server.url, "--model", "eval-alias", "--dataset", str(data), "--reward", "exact"]  # fmt: skip
        assert main(argv) == 2
    finally:
        httpx.post(f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": "eval-alias"}, timeout=60)
    err = capsys.readouterr().err
    assert f"'eval-alias' is a LoRA adapter of '{vllm_server.model_name}'" in err
    assert f"pass --tokenizer {vllm_server.model_name}" in err and err.count("\n") == 1
    alias = [{"id": "policy", "root": "Qwen/Qwen3-4B"}]  # what `--served-model-name policy` lists
    with pytest.raises(ValueError, match="server's name for Qwen/Qwen3-4B.*pass --tokenizer Qwen/Qwen3-4B"):
        tokenizer_source("policy", alias)
    assert (
        tokenizer_source("Qwen/Qwen3-4B", [{"id": "Qwen/Qwen3-4B", "root": "Qwen/Qwen3-4B"}])
        == "Qwen/Qwen3-4B"
    )


def length_reward(completions, **_):
    return [float(len(str(c))) for c in completions]


def test_rollouts_reach_the_output_as_they_finish_so_a_crash_keeps_them(
    fault_proxy, server_config, tool_tokenizer, tmp_path
):
    """The server dies after the first prompt's two rollouts: that prompt's lines are already written."""
    out = tmp_path / "out.jsonl"

    async def go():
        async with fault_proxy(["pass", "pass"] + ["500"] * 50) as url:
            config = server_config(
                vllm_server_base_url=url,
                max_concurrent_rollouts=2,
                vllm_max_retries=1,
                vllm_retry_backoff_s=0.5,
            )
            rows = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
            with pytest.raises(ServerUnavailableError):
                await evaluate(
                    config, tokenizer=tool_tokenizer, dataset=rows, reward_funcs=[length_reward],
                    output_path=out, progress=False,
                )  # fmt: skip

    asyncio.run(go())
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row_index"], r["generation"]) for r in lines] == [(0, 0), (0, 1)]


def test_malformed_rows_are_named_by_file_and_line(tmp_path):
    path = _write_rows(
        tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": ""}, {"prompt": [{"role": "user"}]}]
    )
    with pytest.raises(ValueError, match=r"d\.jsonl:2: 'prompt' must be a non-empty string"):
        load_eval_dataset(str(path))
    loaded = load_eval_dataset(str(path), skip_bad_rows=True)
    assert [r["prompt"] for r in loaded.rows] == [[{"role": "user", "content": "ok"}]]
    assert [s.split(": ")[0].rsplit(":", 1)[1] for s in loaded.skipped] == ["2", "3"]
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps([{"prompt": "a"}, 7]))
    with pytest.raises(ValueError, match=r"d\.json item 1: a row must be a JSON object, got int"):
        load_eval_dataset(str(listed))


def test_reasoning_gym_tasks_load_and_score_with_their_own_scorer():
    from agrpo_rollout._evaluation import gym_score

    rows = load_eval_dataset("basic_arithmetic", num_prompts=3, seed=1).rows
    assert len(rows) == 3 and rows[0]["prompt"][0]["role"] == "user"
    right = [[{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}] for r in rows]
    assert gym_score(right, entry=[r["entry"] for r in rows]) == [1.0, 1.0, 1.0]
    assert gym_score(["nonsense"] * 3, entry=[r["entry"] for r in rows]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"nor a reasoning-gym task .*did you mean 'basic_arithmetic'"):
        load_eval_dataset("basic_arithmatic")


def test_library_warnings_name_the_commands_flags():
    import logging

    from agrpo_rollout.__main__ import _FlagNames

    record = logging.LogRecord(
        "agrpo_rollout", logging.WARNING, __file__, 1, "max_completion_length=%d >= x", (9,), None
    )
    assert _FlagNames().filter(record) and record.getMessage() == "--max-completion-length=9 >= x"


def test_a_wrong_model_name_is_named_before_the_tokenizer_loads(
    vllm_server, tiny_qwen3_dir, tmp_path, capsys
):
    data = _write_rows(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}])
    argv = ["eval", "--base-url", vllm_server.url, "--model", "qwen3-tiny", "--tokenizer", str(tiny_qwen3_dir),
            "--dataset", str(data), "--reward", "exact"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--model 'qwen3-tiny' is not served (the server serves ['{vllm_server.model_name}'" in err


def test_a_prompt_longer_than_the_servers_context_is_named_or_skipped(vllm_server, tmp_path, capsys):
    long_prompt = "the " * (vllm_server.max_model_len + 10)
    data = _write_rows(
        tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}, {"prompt": long_prompt, "answer": "1"}]
    )
    base = ["eval", "--base-url", vllm_server.url, "--model", vllm_server.model_name, "--dataset", str(data),
            "--reward", "exact", "--num-generations", "2", "--max-completion-length", "4", "--no-progress"]  # fmt: skip
    assert main(base) == 2
    err = capsys.readouterr().err
    assert (
        "p.jsonl:2: the prompt is " in err
        and f"the server's max_model_len is {vllm_server.max_model_len}" in err
    )
    assert "--max-model-len, or pass --skip-bad-rows" in err and err.count("\n") == 1
    assert main([*base, "--skip-bad-rows"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("skipped 1 malformed rows") and "p.jsonl:2: the prompt is" in printed[0]
    assert json.loads(printed[-1])["num_prompts"] == 1


def test_parquet_with_named_columns_shows_a_progress_bar_and_a_one_screen_summary(
    vllm_server, tmp_path, capsys
):
    import datasets

    rows = {"question": [f"What is {i}+{i}?" for i in range(3)], "solution": [str(2 * i) for i in range(3)]}
    path = tmp_path / "q.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    out = tmp_path / "out.jsonl"
    argv = ["eval", "--base-url", vllm_server.url, "--model", vllm_server.model_name, "--dataset", str(path),
            "--prompt-column", "question", "--answer-column", "solution", "--reward", "exact",
            "--reward", "contains", "--num-generations", "2", "--max-completion-length", "4", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "eval: 100%" in captured.err and "3/3" in captured.err and "pass@1" in captured.err, captured.err
    summary = captured.out.splitlines()
    assert summary[0] == f"agrpo-rollout eval: {path} on {vllm_server.model_name} at {vllm_server.url}"
    labels = [line.split()[0] for line in summary[1:-1]]
    assert labels == ["prompts", "mean", "pass@1", "pass@2", "completions", "throughput", "output"]
    assert "exact_match" in summary[2] and "contains_answer" in summary[2]
    assert len(summary) <= 24, "one screen"
    report = json.loads(summary[-1])
    assert report["num_prompts"] == 3 and set(report["mean_reward_by_func"]) == {
        "exact_match",
        "contains_answer",
    }
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and lines[0]["prompt"] == [{"role": "user", "content": "What is 0+0?"}]


def test_prompt_lengths_are_the_loops_and_long_ones_are_skipped_or_named(tool_tokenizer, tmp_path):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    rendered = tool_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert prompt_length(tool_tokenizer, messages) == len(rendered)
    assert prompt_length(tool_tokenizer, "plain text") == len(tool_tokenizer.encode("plain text"))
    data = load_eval_dataset(str(_write_rows(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])))
    assert data.origins == [f"{tmp_path}/d.jsonl:1", f"{tmp_path}/d.jsonl:2"]
    kept = fit_context(data, [10, 64], 64, skip_bad_rows=True)
    assert [r["prompt"][0]["content"] for r in kept.rows] == ["a"] and len(kept.skipped) == 1
    with pytest.raises(
        ValueError, match=r"d\.jsonl:2: the prompt is 64 tokens, the server's max_model_len is 64"
    ):
        fit_context(data, [10, 64], 64, skip_bad_rows=False)


def test_the_readmes_eval_commands_are_valid_command_lines():
    """Every `agrpo-rollout eval ...` line a README shows parses with this command's own parser."""
    root = Path(__file__).resolve().parents[3]
    commands = []
    for readme in (root / "README.md", root / "packages" / "agrpo-rollout" / "README.md"):
        text = readme.read_text().replace("\\\n", " ")
        commands += [
            line.split("  # ")[0] for line in text.splitlines() if line.startswith("agrpo-rollout eval ")
        ]
    assert len(commands) >= 3, commands
    for command in commands:
        args = _parser().parse_args(shlex.split(command)[1:])
        assert args.command == "eval" and args.reward, command


def test_ctrl_c_keeps_the_finished_rollouts_and_says_where(vllm_server, tmp_path):
    """Ctrl-C while requests are in flight: the server is paused (`keep`) as soon as the first group lands, so
    the eval is mid-run when the signal comes however fast the tiny model answers. The child gets SIGINT's
    default disposition, as a terminal's foreground process has it: a suite started in the background (`cmd &`)
    ignores SIGINT, and its children inherit that, which made this test flaky."""
    data = _write_rows(tmp_path / "p.jsonl", [{"prompt": f"question {i}", "answer": "1"} for i in range(500)])
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "agrpo_rollout", "eval", "--base-url", vllm_server.url, "--model",
            vllm_server.model_name, "--dataset", str(data), "--reward", "exact", "--num-generations", "2",
            "--max-completion-length", "64", "--max-concurrent-rollouts", "2", "--output", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    with httpx.Client(base_url=vllm_server.url, timeout=30) as control:
        try:
            deadline = time.monotonic() + 180
            while (
                not (out.exists() and out.read_text()) and time.monotonic() < deadline and proc.poll() is None
            ):
                time.sleep(0.05)
            control.post("/pause", params={"mode": "keep"}).raise_for_status()
            assert proc.poll() is None, "the eval ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            control.post("/resume").raise_for_status()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"agrpo-rollout eval: interrupted; the rollouts finished before it are in {out}"
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(lines) < 1000 and len(lines) % 2 == 0, "whole groups only"


def test_a_server_left_paused_is_named_on_stderr_and_the_eval_finishes_once_resumed(vllm_server, tmp_path):
    """The eval runs the rollout loop, so it names a paused server (`ServerPause`, `test_server_pause.py`): one
    warning on stderr with the fix, then, resumed, the run ends normally."""
    data = _write_rows(tmp_path / "p.jsonl", [{"prompt": f"question {i}", "answer": "1"} for i in range(2)])
    argv = [sys.executable, "-m", "agrpo_rollout", "eval", "--base-url", vllm_server.url, "--model",
            vllm_server.model_name, "--dataset", str(data), "--reward", "exact", "--num-generations", "2",
            "--max-completion-length", "8", "--no-progress"]  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    with httpx.Client(base_url=vllm_server.url, timeout=30) as control:
        control.post("/pause", params={"mode": "keep"}).raise_for_status()
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
            reader.start()
            seen, deadline = [], time.monotonic() + 60
            while not any("is paused" in line for line in seen) and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    seen.append(lines.get(timeout=1))
            assert proc.poll() is None, "".join(seen)
        finally:
            control.post("/resume").raise_for_status()
    proc.wait(timeout=120)  # the summary fits in the pipe's buffer; stderr is the reader's
    reader.join(timeout=10)
    out = proc.stdout.read()
    seen += list(lines.queue)
    warnings = [line for line in seen if "is paused" in line]
    assert proc.returncode == 0 and json.loads(out.strip().splitlines()[-1])["num_rollouts"] == 4, seen
    assert len(warnings) == 1 and warnings[0].startswith(
        f"WARNING agrpo_rollout: vLLM server {vllm_server.url}"
    )
    assert f"POST {vllm_server.url}/resume serves its weights as they are" in warnings[0]
