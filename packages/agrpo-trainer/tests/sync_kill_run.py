"""Run by `test_sync_kill.py` in its own process: trains against the real server with disk sync and SIGKILLs
itself at one phase of its second push (version 2), so the test can see what the server is left with.

usage: python sync_kill_run.py URL MODEL_DIR OUTPUT_DIR PHASE
PHASE: `after-pause` (the server paused, nothing sent), `during-reload` (the reload request in flight),
`before-resume` (reloaded and labelled, not resumed yet).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
from rollout_doubles import rank_reward

from agrpo_sync import ServerControl
from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer

KILL_VERSION = 2
_state = {"version": None}


def _die() -> None:
    print(f"sync_kill_run: SIGKILL at version {_state['version']}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _hook(phase: str) -> None:
    pause, reload, label = ServerControl.pause, ServerControl.reload_weights, ServerControl.set_weight_version

    def paused(self, mode, clear_cache):
        pause(self, mode, clear_cache)
        if phase == "after-pause" and _state["version"] == KILL_VERSION:
            _die()

    def reloading(self, weights_path):
        if phase == "during-reload" and _state["version"] == KILL_VERSION:
            request = threading.Thread(target=reload, args=(self, weights_path), daemon=True)
            request.start()
            request.join(0.02)  # on its way, or just answered: either way the version is not labelled yet
            _die()
        reload(self, weights_path)

    def labelled(self, version):
        label(self, version)
        if phase == "before-resume" and int(version) == KILL_VERSION:
            _die()
        _state["version"] = int(version) + 1  # the next push's version

    ServerControl.pause, ServerControl.reload_weights, ServerControl.set_weight_version = (
        paused,
        reloading,
        labelled,
    )


def main() -> None:
    url, model_dir, output_dir, phase = sys.argv[1:5]
    torch.set_num_threads(1)
    _hook(phase)
    _state["version"] = 1
    args = AsyncGRPOConfig(
        output_dir=output_dir, vllm_server_base_url=url, weight_sync_backend="disk", bf16=False, use_cpu=True,
        learning_rate=1e-3, num_generations=4, max_completion_length=8, per_device_train_batch_size=8,
        token_budget=0, max_steps=20, save_strategy="no", report_to="none", disable_tqdm=True,
        activation_checkpointing=False, sync_parity_probe_tokens=0, max_concurrent_rollouts=8,
    )  # fmt: skip
    prompts = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(16)]
    AsyncGRPOTrainer(model_dir, rank_reward, args=args, train_dataset=prompts).train()


if __name__ == "__main__":
    main()
