"""The baseline of `tools.bench.packing`: the same job done with a straightforward per-token trie.

Owns only the baseline planner: rows of `TokenTrieRow` (one dict lookup per token to price and to add
a sample, one loop iteration per token to pack), filled first-fit with group routing, the shape of
the reference implementation's tree packing. No attention-cost balance, so it does strictly less
planning work than `Planner`.
"""

from __future__ import annotations

from agrpo_packing import PackedRow, PackSample
from agrpo_packing.testing import TokenTrieRow


def _fits(row: TokenTrieRow, terms: int, sample: PackSample, budget: int) -> bool:
    return row.num_nodes + row.novel_nodes(sample) <= budget and terms + sample.num_trained <= budget


def plan_and_pack(samples: list[PackSample], token_budget: int, num_ranks: int) -> list[PackedRow]:
    """Every row of every micro-batch, packed."""
    closed: list[TokenTrieRow] = []
    rows, terms, holder = [TokenTrieRow() for _ in range(num_ranks)], [0] * num_ranks, {}
    for sample in samples:
        order = [holder[sample.group_id]] if sample.group_id in holder else []
        order += [i for i in range(num_ranks) if i not in order]
        target = next((i for i in order if _fits(rows[i], terms[i], sample, token_budget)), None)
        if target is None:
            closed += rows
            rows, terms, holder, target = [TokenTrieRow() for _ in range(num_ranks)], [0] * num_ranks, {}, 0
        rows[target].add(sample)
        terms[target] += sample.num_trained
        holder[sample.group_id] = target
    return [row.pack() for row in closed + rows]
