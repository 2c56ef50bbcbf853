"""Run by `test_distributed.py` under torchrun (or alone): a few optimizer steps of the trainer on fixed
samples, then rank 0 saves the parameters. One rank with rows of 8 samples and two gloo ranks with rows of 4
see the same 8 samples per micro-batch, so with step-level normalisation they must end on the same weights.

usage: python distributed_replay.py OUT_FILE [--fsdp] [--cuda] [--backend=NAME]

`--cuda` runs in the trainer's real precision on a GPU (fp32 master weights, bf16 autocast, gradient
checkpointing) and keeps the last checkpoint, whose dtypes the caller inspects (SPEC F-CKPT).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from rollout_doubles import fixed_samples

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer.testing import ReplayTrainer


def checkpoint_dtypes(output_dir: str) -> dict:
    """Files of the last checkpoint, and the dtypes of its saved model and of its optimizer state."""
    from pathlib import Path

    from safetensors import safe_open
    from transformers.trainer_utils import get_last_checkpoint

    folder = Path(get_last_checkpoint(output_dir))
    with safe_open(folder / "model.safetensors", "pt") as f:
        model = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})  # noqa: SIM118 - safe_open is no dict
    optimizer_file = next(p for p in folder.iterdir() if p.name.startswith("optimizer"))
    state = torch.load(optimizer_file, map_location="cpu", weights_only=False)
    tensors = [
        v for s in state.get("state", {}).values() for v in s.values() if torch.is_tensor(v) and v.ndim
    ]
    return {"files": sorted(p.name for p in folder.iterdir()), "model": model,
            "optimizer": sorted({str(t.dtype) for t in tensors})}  # fmt: skip


def main() -> None:
    out_file, use_fsdp, cuda = sys.argv[1], "--fsdp" in sys.argv, "--cuda" in sys.argv
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(TinyModelSpec(seed=7, tie_word_embeddings=False), tokenizer)
    samples = fixed_samples(
        build_model(TinyModelSpec(seed=7, tie_word_embeddings=False), tokenizer), num_prompts=6
    )
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    fsdp = (
        {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}}
        if use_fsdp
        else {}
    )
    backend = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--backend=")), "auto")
    device = {"bf16": True, "save_steps": 3, "attention_backend": backend} if cuda else {
        "use_cpu": True, "bf16": False, "activation_checkpointing": False, "save_strategy": "no",
        "ddp_backend": "gloo" if world > 1 else None,
    }  # fmt: skip
    args = AsyncGRPOConfig(
        output_dir=out_file + ".run", learning_rate=1e-3, max_steps=3, gradient_accumulation_steps=2,
        per_device_train_batch_size=8 // world, token_budget=0, report_to="none", disable_tqdm=True, seed=0,
        **device, **fsdp,
    )  # fmt: skip
    ReplayTrainer.replay_samples = samples
    trainer = ReplayTrainer(model, reward_funcs=None, args=args, train_dataset=[{"prompt": "x"}] * 6,
                            processing_class=tokenizer)  # fmt: skip
    trainer.train()
    state = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        weights = {k: v.detach().cpu() for k, v in state.items()}
        info = {"fsdp": trainer.is_fsdp_enabled, "world": world, "backend": trainer.attention_backend}
        if cuda:
            info["checkpoint"] = checkpoint_dtypes(args.output_dir)
        torch.save({"weights": weights, **info, "log": trainer.state.log_history}, out_file)


if __name__ == "__main__":
    main()
