"""`agrpo_attention.testing`: tiny random models and a tokenizer with real chat templates, built offline.

Owns nothing itself: it is the public face of `_tiny_tokenizer.py` (byte-level BPE, a tool-calling
ChatML template and a history-rewriting variant, a `response_template`) and `_tiny_model.py` (Qwen3
dense, Qwen3.5 and Qwen3-Next Gated DeltaNet hybrids, Qwen3-MoE; OLMoE and Mixtral for routing replay; gpt-oss
(learned sinks), Gemma 2 (softcapping), Gemma 3 (text, and with a tiny SigLIP vision tower) and Mistral for
sliding windows, `TinyModelSpec.sliding_window` wide). These are
exactly the model families tree attention runs, built from the torch + transformers this package already needs,
which is why they live here: agrpo-packing has no transformers and agrpo-rollout no torch. Tests, README examples, the demo and
benchmarks of every agrpo package use them; nothing touches the network.

By hand: `python -m agrpo_attention.testing OUT_DIR [--kind hybrid]` writes the model files vLLM reads (the
CPU build serves `qwen3`; it cannot import its Qwen3.5 hybrid code without torchvision: agrpo_rollout.testing).
"""

from __future__ import annotations

import argparse

from ._tiny_model import TinyModelSpec, build_model, save_tiny_model
from ._tiny_tokenizer import (
    HISTORY_REWRITE_TEMPLATE,
    RESPONSE_TEMPLATE,
    SPECIAL_TOKENS,
    TEMPLATES,
    TOOL_TEMPLATE,
    build_tokenizer,
)

__all__ = [
    "HISTORY_REWRITE_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "TOOL_TEMPLATE",
    "TinyModelSpec",
    "build_model",
    "build_tokenizer",
    "let_triton_run_on_cpu",
    "save_tiny_model",
]


def let_triton_run_on_cpu() -> None:
    """Let agrpo's Triton delta rule and path convolution run off CUDA, for Triton's interpreter
    (`TRITON_INTERPRET=1`, set before triton is imported): the CPU seam of the GPU path, for tests only."""
    from . import _tree_deltanet

    _tree_deltanet._UNAVAILABLE_REASON["triton"] = lambda device: None
    _tree_deltanet._conv_runs_triton = lambda mixed, kernel: kernel == "triton"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agrpo_attention.testing", description="Build a tiny random model + tokenizer offline."
    )
    parser.add_argument("out_dir")
    parser.add_argument(
        "--kind",
        default="qwen3",
        choices=[
            *("qwen3", "hybrid", "qwen3_next", "moe", "olmoe", "mixtral", "qwen3_next_moe"),
            *("gpt_oss", "gemma2", "gemma3", "gemma3_vlm", "mistral"),
        ],
    )
    parser.add_argument("--template", default="tools", choices=sorted(TEMPLATES))
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--untied", action="store_true", help="give the LM head its own weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        kind=args.kind,
        template=args.template,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        tie_word_embeddings=not args.untied,
        seed=args.seed,
    )
    print(save_tiny_model(args.out_dir, spec))


if __name__ == "__main__":
    main()
