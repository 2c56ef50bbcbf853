"""`agrpo-trainer` (`_cli`, `_run_spec`): config files and flags through HfArgumentParser, rewards and datasets
by name, and (against the real CPU server) `accelerate launch -m agrpo_trainer train` on two CPU processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from report_reader import read_curves

from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer._cli import main, parse_train_args, train_parser
from agrpo_trainer._run_spec import RunSpec, load_prompts, resolve_reward
from agrpo_trainer.rewards import CharacterFractionReward, accuracy_reward

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_yaml_file_sets_the_fields_and_flags_override_it(tmp_path):
    config = _write(
        tmp_path / "run.yaml",
        f"""
model_name_or_path: Qwen/Qwen3-4B
dataset_name: prompts.jsonl
reward_funcs: [accuracy_reward, CharacterFractionReward]
output_dir: {tmp_path / "out"}
num_generations: 4
learning_rate: 3.0e-6
use_cpu: true
score_centering: false
fsdp_config: {{fsdp_version: 2}}
""",
    )
    spec, args = parse_train_args(
        [str(config), "--learning_rate", "1e-5", "--max_steps", "7", "--bf16", "false"]
    )
    assert spec == RunSpec("Qwen/Qwen3-4B", "prompts.jsonl", ["accuracy_reward", "CharacterFractionReward"])
    assert isinstance(args, AsyncGRPOConfig) and args.output_dir == str(tmp_path / "out")
    assert (args.num_generations, args.learning_rate, args.max_steps, args.bf16) == (4, 1e-5, 7, False)
    assert args.score_centering is False, "a field whose default is True (it also has a --no_ flag)"
    assert args.fsdp_config["fsdp_version"] == 2 and args.logging_steps == 1, "the reference's defaults hold"


def test_a_json_file_works_and_flags_alone_work(tmp_path):
    config = _write(tmp_path / "run.json", json.dumps({"model_name_or_path": "m", "dataset_name": "d",
                                                       "output_dir": str(tmp_path), "top_k": 20}))  # fmt: skip
    _, args = parse_train_args([str(config), "--reward_funcs", "accuracy_reward", "think_format_reward"])
    assert args.top_k == 20
    spec, _ = parse_train_args(
        ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path)]
    )
    assert spec.reward_funcs == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["run.yaml"], "unknown fields ['num_generation']"), (["run.yaml", "--num_generation", "4"], "unrecognised"),
     (["missing.yaml"], "does not exist"), (["run.yaml", "--epsilon", "0"], "epsilon=0.0; it must be > 0")],
)  # fmt: skip
def test_bad_input_names_the_field(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    text = "model_name_or_path: m\ndataset_name: d\n" + (
        "num_generation: 4\n" if argv == ["run.yaml"] else ""
    )
    _write(tmp_path / "run.yaml", text)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_train_args(argv)


def test_help_lists_every_config_and_run_field_as_a_flag():
    text = train_parser().format_help()
    names = [f.name for cls in (RunSpec, AsyncGRPOConfig) for f in dataclasses.fields(cls) if f.init]
    missing = [n for n in names if f"--{n} " not in text and f"--{n}\n" not in text]
    assert not missing, f"not in --help: {missing}"
    assert "Sampling temperature" in text and "Peak FLOP/s" in text, "each flag carries its help text"


def test_the_module_runs_as_the_command(tmp_path, capsys):
    done = subprocess.run([sys.executable, "-m", "agrpo_trainer", "train", "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert (
        done.returncode == 0 and "--vllm_server_base_url" in done.stdout and "--reward_funcs" in done.stdout
    )
    with pytest.raises(SystemExit, match="agrpo-trainer train: error: no reward function"):
        main(["train", "--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit) as shown:
        main([])
    assert shown.value.code == 0 and "train" in capsys.readouterr().out


def test_rewards_resolve_by_built_in_name_or_module_attribute(tmp_path, monkeypatch):
    assert resolve_reward("accuracy_reward") is accuracy_reward
    assert resolve_reward("CharacterFractionReward") == CharacterFractionReward()
    _write(
        tmp_path / "my_rewards.py",
        "def shout(completions, **kw):\n    return [float('!' in c) for c in completions]\n",
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # another test's module of that name
    assert resolve_reward("my_rewards:shout")(["a!", "b"]) == [1.0, 0.0]
    for name, message in [("LengthReward", "needs arguments"), ("accuracy", "not a built-in reward"),
                          ("my_rewards:whisper", "no attribute 'whisper'"), ("nope_mod:f", "cannot import")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            resolve_reward(name)


def test_datasets_load_from_local_files(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(3)]
    _write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    dataset = load_prompts(RunSpec("m", str(tmp_path / "p.jsonl")))
    assert (
        dataset.num_rows == 3 and dataset[1]["solution"] == "1" and dataset[0]["prompt"][0]["content"] == "q0"
    )
    dataset.save_to_disk(str(tmp_path / "saved"))
    assert load_prompts(RunSpec("m", str(tmp_path / "saved"))).num_rows == 3
    with pytest.raises(ValueError, match="is a .txt file"):
        load_prompts(RunSpec("m", str(_write(tmp_path / "p.txt", "x"))))


@pytest.mark.server
def test_accelerate_launches_the_module_on_two_cpu_processes(training_server, untied_qwen3_dir, tmp_path):
    from agrpo_rollout.testing import free_port

    prompts = [{"prompt": [{"role": "user", "content": f"Say a number, {i}."}]} for i in range(8)]
    _write(tmp_path / "prompts.jsonl", "\n".join(json.dumps(p) for p in prompts))
    config = _write(
        tmp_path / "run.yaml",
        f"""
model_name_or_path: {untied_qwen3_dir}
dataset_name: {tmp_path / "prompts.jsonl"}
reward_funcs: [CharacterFractionReward]
output_dir: {tmp_path / "run"}
vllm_server_base_url: {training_server.url}
weight_sync_backend: disk
use_cpu: true
bf16: false
gradient_checkpointing: false
ddp_backend: gloo
num_generations: 4
max_completion_length: 8
per_device_train_batch_size: 4
token_budget: 0
save_steps: 2
report_to: none
disable_tqdm: true
""",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--main_process_port", str(free_port()), "-m", "agrpo_trainer", "train", str(config),
               "--max_steps", "2", "--learning_rate", "1e-4"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    steps = [h for h in state["log_history"] if "batch/samples_per_step" in h]
    assert [h["batch/samples_per_step"] for h in steps] == [8.0, 8.0], (
        "two ranks x 4 samples per optimizer step"
    )
    assert read_curves(tmp_path / "run" / "report.html")["reward"][0] == [1, 2]
