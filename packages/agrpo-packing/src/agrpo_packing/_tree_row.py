"""`TreeRow`: the prefix trie over the samples of one row, grown one sample at a time.

Owns admission (`fits`, `add`) and the running totals the planner balances on. Does not know other
rows or ranks (the planner) nor the tensor layout (`_row_layout.build_packed_row`, called by `pack`).

The trie is never materialised per token. The row keeps its entries sorted by key (see
`_trie_entry`), each with the number of nodes it shares with its sorted predecessor; in a sorted
list a sample shares the most with one of its two neighbours, so pricing a sample is a bisect plus two
vectorised prefix comparisons, and the unique-token count grows by exactly the sample's novel nodes.

Price: a row holds at most `token_budget` unique tokens (trie nodes) and at most `token_budget` loss
terms. Novel tokens bound activations, loss terms bound the log-prob head; a sample costs both, and
since a sample never has more loss terms than nodes, a sample that fits an empty row alone is exactly
one whose forwarded length (position of its last trained token) is within the budget.
Cost: causal attention score pairs, sum over nodes of (depth + 1); it is additive under insertion.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from ._exceptions import PackingError, RowFullError
from ._packed_row import PackedRow
from ._row_layout import build_packed_row
from ._sample import PackSample
from ._trie_entry import TrieEntry, score_pairs, shared_nodes


@dataclass(slots=True, frozen=True)
class RowProbe:
    """What adding one entry to one row would do."""

    slot: int
    """Index in the sorted entry list where the entry goes."""
    shared_prev: int
    """Nodes shared with the sorted predecessor."""
    shared_next: int
    """Nodes shared with the sorted successor."""
    novel_tokens: int
    """Trie nodes the row gains."""
    added_cost: int
    """Attention score pairs the row gains."""
    row_size: int
    """Samples the row held when probed: a probe is valid only until the row changes."""


class TreeRow:
    """One DP rank's forward in one micro-batch: a prefix trie holding up to `token_budget` unique tokens.

    `token_budget <= 0` means unbounded. `share_prefixes=False` is plain mode: every sample is its own
    root segment (ordinary padding-free varlen packing), in order of `add`."""

    def __init__(self, token_budget: int, *, share_prefixes: bool = True) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int):
            raise TypeError(f"token_budget must be an int (<= 0 for unbounded), got {token_budget!r}")
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        self.num_tokens = 0
        """Unique tokens (trie nodes) the row forwards."""
        self.num_loss_terms = 0
        self.num_raw_tokens = 0
        """Sum of the samples' lengths."""
        self.cost = 0
        """Causal attention score pairs of the packed row."""
        self.group_ids: set[int] = set()
        self._entries: list[TrieEntry] = []
        self._sorted: list[TrieEntry] = []
        self._keys: list[bytes] = []
        self._shared: list[int] = []
        self._cached: TrieEntry | None = None

    @property
    def samples(self) -> tuple[PackSample, ...]:
        """The samples in order of `add`; loss terms carry indices into this."""
        return tuple(e.sample for e in self._entries)

    @property
    def num_samples(self) -> int:
        return len(self._entries)

    @property
    def is_empty(self) -> bool:
        return not self._entries

    @property
    def packing_ratio(self) -> float:
        return self.num_raw_tokens / max(self.num_tokens, 1)

    def fits(self, sample: PackSample) -> bool:
        """Whether adding `sample` keeps the row within its budget of unique tokens and loss terms."""
        entry = self._entry(sample)
        return self._fits_probe(entry, self._probe(entry))

    def add(self, sample: PackSample) -> None:
        """Insert `sample`; raises `RowFullError` when it does not fit."""
        entry = self._entry(sample)
        self._insert(entry, self._probe(entry))

    def extend(self, samples: Iterable[PackSample]) -> None:
        for sample in samples:
            self.add(sample)

    def pack(self) -> PackedRow:
        """The row's tensors, laid out depth-first (see `PackedRow`)."""
        return build_packed_row(self._entries, self._sorted, self._shared)

    def _probe(self, entry: TrieEntry) -> RowProbe:
        """Price `entry` against this row without changing it."""
        if not self.share_prefixes or entry.num_nodes == 0:
            pairs = score_pairs(0, entry.num_nodes)
            return RowProbe(len(self._sorted), 0, 0, entry.num_nodes, pairs, len(self._entries))
        slot = bisect.bisect_right(self._keys, entry.key)
        prev = shared_nodes(self._sorted[slot - 1], entry) if slot > 0 else 0
        nxt = shared_nodes(entry, self._sorted[slot]) if slot < len(self._sorted) else 0
        start = max(prev, nxt)
        pairs = score_pairs(start, entry.num_nodes)
        return RowProbe(slot, prev, nxt, entry.num_nodes - start, pairs, len(self._entries))

    def _fits_probe(self, entry: TrieEntry, probe: RowProbe) -> bool:
        if self.token_budget <= 0:
            return True
        return (
            self.num_tokens + probe.novel_tokens <= self.token_budget
            and self.num_loss_terms + entry.num_loss_terms <= self.token_budget
        )

    def _insert(self, entry: TrieEntry, probe: RowProbe) -> None:
        """Add a probed entry (the probe must come from this row in its current state)."""
        if probe.row_size != len(self._entries):
            raise PackingError("stale RowProbe: the row changed since it was probed; probe it again")
        if not self._fits_probe(entry, probe):
            raise RowFullError(
                f"sample of {entry.num_nodes} forwarded tokens and {entry.num_loss_terms} loss terms adds "
                f"{probe.novel_tokens} unique tokens to a row holding {self.num_tokens} tokens and "
                f"{self.num_loss_terms} loss terms, over token_budget={self.token_budget}; check fits() "
                "first and open a new row when it is False"
            )
        self._entries.append(entry)
        if entry.num_nodes:
            self._sorted.insert(probe.slot, entry)
            self._keys.insert(probe.slot, entry.key)
            self._shared.insert(probe.slot, probe.shared_prev)
            if probe.slot + 1 < len(self._shared):
                self._shared[probe.slot + 1] = probe.shared_next
        self.num_tokens += probe.novel_tokens
        self.num_loss_terms += entry.num_loss_terms
        self.num_raw_tokens += entry.sample.num_tokens
        self.cost += probe.added_cost
        self.group_ids.add(entry.sample.group_id)

    def _entries_in_key_order(self) -> list[TrieEntry]:
        """The row's entries, those sharing prefixes next to each other (for planners that split rows)."""
        return [*self._sorted, *(e for e in self._entries if not e.num_nodes)]

    def _entry(self, sample: PackSample) -> TrieEntry:
        """The entry of `sample`, reused between a `fits` and the `add` that follows it."""
        cached = self._cached
        if cached is None or cached.sample is not sample:
            cached = self._cached = TrieEntry.of(sample)
        return cached

    def __repr__(self) -> str:
        return (
            f"TreeRow(samples={self.num_samples}, tokens={self.num_tokens}/{self.token_budget}, "
            f"loss_terms={self.num_loss_terms}, cost={self.cost}, ratio={self.packing_ratio:.2f})"
        )
