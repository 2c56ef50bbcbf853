"""GRPO-shaped samples for the train-step benchmark: whole groups at a target packing ratio.

Owns the shapes. With G rollouts of Lc completion tokens after a shared Lp-token prompt the packing
ratio is G (Lp + Lc) / (Lp + G Lc): short prompts and long completions give ~1, long prompts and short
completions 3.4 or 8. Every sample carries the sampler's top-8 log-probs, so the step runs score
centering as the trainer's defaults do. Does not know models, packing or timing.
"""

from __future__ import annotations

from agrpo_packing import PackSample
from agrpo_packing.testing import GroupShape, random_grpo_groups

# target ratio -> (rollouts per prompt, prompt token range, completion token range)
RATIO_SHAPES: dict[float, tuple[int, tuple[int, int], tuple[int, int]]] = {
    1.0: (8, (512, 768), (2048, 4096)),
    3.4: (8, (1792, 2304), (384, 600)),
    8.0: (16, (2400, 3200), (150, 250)),
}
TINY_SHAPES: dict[float, tuple[int, tuple[int, int], tuple[int, int]]] = {
    1.0: (4, (8, 12), (48, 64)),
    3.4: (4, (96, 128), (16, 24)),
    8.0: (8, (160, 200), (8, 12)),
}


def grpo_samples(
    ratio: float, *, num_prompts: int, vocab: int, tiny: bool = False, seed: int = 0
) -> list[PackSample]:
    """`num_prompts` whole groups of the ratio's shape (single-turn), with sampler top-8 log-probs."""
    shapes = TINY_SHAPES if tiny else RATIO_SHAPES
    rollouts, prompt, completion = shapes[ratio]
    shape = GroupShape(
        num_prompts=num_prompts, rollouts_per_prompt=rollouts, prompt_tokens=prompt,
        completion_tokens=completion, multi_turn_frac=0.0, vocab_size=vocab, sampler_top_k=8,
    )  # fmt: skip
    return random_grpo_groups(shape, seed=seed)
