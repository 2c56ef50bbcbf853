"""`TrieEntry`: one `PackSample` as a prefix trie stores it.

Owns what packing derives from a sample once: the tokens it forwards, its sort key and its trained
positions. Does not know rows, budgets or layouts.

Trie nodes are keyed on (token, next token), so a node predicts exactly one token. A sample whose last
trained token sits at position j therefore needs exactly j nodes, at depths 0..j-1 (node d holds token
`input_ids[d]` and predicts `input_ids[d + 1]`): tokens from j on predict no loss term and are never
forwarded. Two samples share node d iff they agree on tokens 0..d+1, so with `lcp` the length of their
common token prefix they share `max(lcp - 1, 0)` nodes.

The key is the raw bytes of `input_ids[:j + 1]`. Bytes compare token by token (8 bytes per token), so
sorting keys is a lexicographic order over token sequences (with an unusual but consistent order on
tokens): prefixes sort first and samples with a common prefix sort together, which is all the trie
needs. A sample with no trained token needs no node at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._sample import PackSample


@dataclass(slots=True)
class TrieEntry:
    """A sample plus the derived data every trie operation reuses."""

    sample: PackSample
    tokens: np.ndarray
    """(num_nodes + 1,) int64 `input_ids[:j + 1]`; empty when nothing is trained."""
    key: bytes
    """`tokens.tobytes()`: the sort key."""
    num_nodes: int
    """Nodes this sample needs alone: j, the position of its last trained token (0 if none)."""
    trained_positions: np.ndarray
    """(T,) int64 positions i with `trained_mask[i]`; loss term t is predicted by node depth i - 1."""

    @classmethod
    def of(cls, sample: PackSample) -> TrieEntry:
        if not isinstance(sample, PackSample):
            raise TypeError(
                f"expected a PackSample, got {type(sample).__name__}; wrap records as PackSample(...)"
            )
        trained = np.flatnonzero(sample.trained_mask)
        num_nodes = int(trained[-1]) if trained.size else 0
        tokens = sample.input_ids[: num_nodes + 1] if num_nodes else sample.input_ids[:0]
        return cls(sample, tokens, tokens.tobytes(), num_nodes, trained)

    @property
    def num_loss_terms(self) -> int:
        return int(self.trained_positions.shape[0])


def shared_nodes(a: TrieEntry, b: TrieEntry) -> int:
    """Trie nodes two entries share: one less than their common token prefix, bounded below by 0."""
    m = min(a.tokens.shape[0], b.tokens.shape[0])
    if m < 2:
        return 0
    differ = a.tokens[:m] != b.tokens[:m]
    first = int(differ.argmax())
    lcp = first if differ[first] else m
    return max(lcp - 1, 0)


def score_pairs(start_depth: int, end_depth: int) -> int:
    """Causal attention score pairs of nodes at depths [start, end): a node at depth d attends d + 1 keys."""
    return (end_depth * (end_depth + 1) - start_depth * (start_depth + 1)) // 2
