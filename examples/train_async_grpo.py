"""The reference's quick start, as a script: asynchronous GRPO of Qwen3-4B on DeepMath with `accuracy_reward`.

GPU (the reference's two terminals, unchanged):

    CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-4B --max-model-len 4096 \\
        --logprobs-mode processed_logprobs --api-server-count 8 --weight-transfer-config '{"backend":"nccl"}'
    CUDA_VISIBLE_DEVICES=1 accelerate launch examples/train_async_grpo.py

CPU, one flag: `uv run python examples/train_async_grpo.py --cpu` builds a tiny random model offline, starts a
local CPU vLLM server for it (about a minute) and trains a few steps with disk weight sync on twelve arithmetic
prompts. A random model never answers right, so beside `accuracy_reward` the CPU run rewards the share of digits
(`CharacterFractionReward`), which gives its groups the reward spread GRPO learns from. With `AGRPO_VLLM_URL`
set, the CPU run attaches to that CPU server (one serving a tiny model of this shape) instead of starting one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from datasets import Dataset, load_dataset

from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer
from agrpo_trainer.rewards import CharacterFractionReward, accuracy_reward


def train_on_gpu() -> None:
    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = AsyncGRPOTrainer(model="Qwen/Qwen3-4B", reward_funcs=accuracy_reward, train_dataset=dataset)
    trainer.train()


def arithmetic_prompts(num: int = 12) -> Dataset:
    """Offline stand-ins for DeepMath's rows: a conversational `prompt` and a `solution` column."""
    rows = [(3 + i, 4 + 2 * i) for i in range(num)]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer in \\boxed{{}}."}],
                "solution": str(a + b),
            }
            for a, b in rows
        ]  # fmt: skip
    )


def cpu_config(output_dir: str, url: str, max_steps: int) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(
        output_dir=output_dir,
        vllm_server_base_url=url,
        weight_sync_backend="disk",  # a CPU server reloads weights from a shared directory, not NCCL
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        learning_rate=5e-3,  # a random model
        num_generations=4,
        max_completion_length=16,
        per_device_train_batch_size=8,
        token_budget=0,
        max_steps=max_steps,
        save_strategy="no",
        report_to="none",
    )


def train_on_cpu(flags: argparse.Namespace) -> AsyncGRPOTrainer:
    from agrpo_attention.testing import TinyModelSpec, save_tiny_model
    from agrpo_rollout.testing import VLLMServer

    work = Path(tempfile.mkdtemp(prefix="agrpo-example-"))
    model_dir = save_tiny_model(work / "model", TinyModelSpec(tie_word_embeddings=False))
    output_dir = flags.output_dir or str(work / "run")
    rewards = [accuracy_reward, CharacterFractionReward()]
    with VLLMServer(model_dir=model_dir, max_model_len=1024) as server:
        args = cpu_config(output_dir, server.url, flags.max_steps)
        trainer = AsyncGRPOTrainer(str(model_dir), rewards, args=args, train_dataset=arithmetic_prompts())
        trainer.train()
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="a tiny model against a local CPU vLLM server")
    parser.add_argument("--max-steps", type=int, default=4, help="with --cpu: optimizer steps")
    parser.add_argument("--output-dir", default=None, help="with --cpu: default, a new temporary directory")
    flags = parser.parse_args()
    if not flags.cpu:
        train_on_gpu()
        return
    trainer = train_on_cpu(flags)
    print(
        f"trained {trainer.state.global_step} steps; report: {Path(trainer.args.output_dir) / 'report.html'}"
    )


if __name__ == "__main__":
    main()
