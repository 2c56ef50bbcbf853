"""GRPO-shaped rows at chosen packing ratios, built with agrpo-packing, for the tree-attention benchmark.

Owns the shapes that put a row near a target packing ratio (raw tokens / unique tokens): with G
rollouts of Lc tokens after a shared Lp-token prompt, ratio = G (Lp + Lc) / (Lp + G Lc). Each
workload is the same samples packed twice: as tree rows (prefix sharing, `TreeRow`) and as plain
padding-free rows (`TreeRow(share_prefixes=False)`, i.e. ordinary varlen sequence packing), each
row holding at most `budget` forwarded tokens. Does not know models or timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from agrpo_packing import PackedRow, PackSample, TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups

# target ratio -> (rollouts per prompt, prompt tokens, completion tokens)
RATIO_SHAPES: dict[float, tuple[int, int, int]] = {
    1.0: (8, 16, 1000),
    2.0: (8, 1024, 768),
    3.4: (8, 2048, 490),
    8.0: (16, 2800, 200),
}


@dataclass(kw_only=True, slots=True)
class Workload:
    """One set of samples, packed both ways."""

    target_ratio: float
    """The ratio the shapes aim at."""
    samples: list[PackSample]
    """Every sample of the workload (whole groups)."""
    tree_rows: list[PackedRow]
    """Prefix-shared rows."""
    plain_rows: list[PackedRow]
    """Padding-free rows without sharing."""

    @property
    def ratio(self) -> float:
        return sum(r.num_raw_tokens for r in self.tree_rows) / sum(r.num_tokens for r in self.tree_rows)

    @property
    def trained_tokens(self) -> int:
        return sum(r.num_loss_terms for r in self.tree_rows)


def _rows(samples: list[PackSample], budget: int, share: bool) -> list[PackedRow]:
    rows = [TreeRow(budget, share_prefixes=share)]
    for sample in samples:
        if not rows[-1].fits(sample):
            rows.append(TreeRow(budget, share_prefixes=share))
        rows[-1].add(sample)
    return [row.pack() for row in rows]


def build_workload(
    target_ratio: float, budget: int, vocab: int, *, scale: float = 1.0, seed: int = 0
) -> Workload:
    """Whole groups of the ratio's shape, as many as fit one tree row of `budget` unique tokens (at least one)."""
    rollouts, prompt, completion = RATIO_SHAPES[target_ratio]
    prompt, completion = max(1, round(prompt * scale)), max(1, round(completion * scale))
    unique_per_group = prompt + rollouts * completion
    groups = max(1, budget // unique_per_group)
    shape = GroupShape(
        num_prompts=groups,
        rollouts_per_prompt=rollouts,
        prompt_tokens=(prompt, prompt),
        completion_tokens=(completion, completion),
        multi_turn_frac=0.0,
        vocab_size=vocab,
    )
    samples = random_grpo_groups(shape, seed=seed)
    return Workload(
        target_ratio=target_ratio,
        samples=samples,
        tree_rows=_rows(samples, max(budget, unique_per_group), True),
        plain_rows=_rows(samples, max(budget, prompt + completion), False),
    )
