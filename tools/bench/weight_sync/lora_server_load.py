"""The real vLLM server's side of adapter sync, per decoder layer of Qwen3-4B's shape: what the GPU machine
(no vLLM there) cannot measure.

Serves, with the CPU build of vLLM, a random model with Qwen3-4B's layer shape (hidden 2560, MLP 9728, 32
query / 8 KV heads of 128) but only `--layers` decoder layers and a small vocabulary (adapters on linear
layers do not depend on it), started with `--enable-lora --max-lora-rank 32`; pushes `--iters` versions of a
rank-32 adapter on every linear layer through `WeightSync` (adapter sync, the window of `max_staleness=2`)
and prints the parts of each send (`LoraAdapterBackend.last_send`). The server's load
(`/v1/load_lora_adapter`) divided by the layers is its per-layer cost; times 36 it estimates a 4B model's.
The CPU server runs float32, so the files are float32 and vLLM casts nothing. Run:
`uv run python -m tools.bench.weight_sync.lora_server_load [--layers 4 --iters 6]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from peft import LoraConfig, get_peft_model

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer, save_tiny_model
from agrpo_rollout.testing import VLLMServer
from agrpo_sync import WeightSync, WeightSyncConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN3_4B_LAYERS = 36


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    spec = TinyModelSpec(
        vocab_size=512, hidden_size=2560, intermediate_size=9728, num_layers=args.layers, num_heads=32,
        num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = save_tiny_model(Path(scratch) / "model", spec)
        flags = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "4"]
        with VLLMServer(model_dir=model_dir, extra_args=flags, max_model_len=512) as server:
            trainer = get_peft_model(
                build_model(spec, build_tokenizer(spec.vocab_size, spec.template, spec.seed)),
                LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=LORA_TARGETS),
            )
            config = WeightSyncConfig(
                base_url=server.url, output_dir=scratch, lora_sync="adapter", max_staleness=2
            )
            sync = WeightSync.start(config, trainer)
            timings, parts = [], []
            for version in range(1, args.iters + 1):
                timings.append(sync.sync(trainer, version))
                parts.append(sync.backend.last_send)
            sync.close()
    loads = [p.load_s for p in parts]
    per_layer = statistics.median(loads) / args.layers
    print(f"vLLM CPU server, Qwen3-4B layer shape x {args.layers} layers, r={args.rank} on every linear layer, "
          f"{timings[0].num_bytes / 1e6:.1f} MB per version (float32), {args.iters} versions")  # fmt: skip
    for index, (t, p) in enumerate(zip(timings, parts, strict=True), start=1):
        print(f"  v{index}: sync {t.weight_sync_s * 1e3:6.1f} ms = copy {p.copy_s * 1e3:5.1f} + write "
              f"{p.write_s * 1e3:5.1f} + server load {p.load_s * 1e3:6.1f} + retire {p.retire_s * 1e3:5.1f} ms")  # fmt: skip
    print(f"server load: median {statistics.median(loads) * 1e3:.1f} ms, max {max(loads) * 1e3:.1f} ms; "
          f"{per_layer * 1e3:.2f} ms per layer, x {QWEN3_4B_LAYERS} = {per_layer * QWEN3_4B_LAYERS * 1e3:.0f} ms "
          "for a 4B model (an estimate: linear in layers)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
