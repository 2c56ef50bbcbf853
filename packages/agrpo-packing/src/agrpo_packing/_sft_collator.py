"""`SFTCollator`: supervised fine-tuning examples -> one prefix-tree row per batch (a `data_collator`).

Owns the conversion of the transformers/TRL SFT convention (`input_ids`, and `labels` equal to
`input_ids` on trained tokens and -100 elsewhere, unshifted, as causal LMs take them) to `PackSample`s
(advantage 1 per trained token, sampler log-prob 0: an SFT loss uses neither) and packs them into one
`TreeRow`. Examples that share a prefix (a system prompt, the earlier turns of a conversation) share its
tokens in the row, so they are forwarded once. Does not know models or the loss: the row goes to
`agrpo_attention.token_logprobs`, whose mean negated is the usual token-mean cross-entropy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._exceptions import PackingError
from ._packed_row import PackedRow
from ._sample import PackSample
from ._tree_row import TreeRow


def _sample(feature: Mapping[str, Any], index: int, ignore_index: int) -> PackSample:
    if "input_ids" not in feature or "labels" not in feature:
        raise PackingError(
            f"example {index} has keys {sorted(feature)}; SFTCollator needs `input_ids` and `labels` "
            f"(labels = input_ids on trained tokens, {ignore_index} elsewhere)"
        )
    ids = np.asarray(feature["input_ids"])
    labels = np.asarray(feature["labels"])
    if labels.shape != ids.shape:
        raise PackingError(f"example {index}: labels {labels.shape} and input_ids {ids.shape} differ in shape")
    trained = labels != ignore_index
    trained[:1] = False  # the first token has no predecessor to predict it (causal LMs shift it away too)
    wrong = np.flatnonzero(trained & (labels != ids))
    if wrong.size:
        i = int(wrong[0])
        raise PackingError(
            f"example {index}: labels[{i}]={int(labels[i])} differs from input_ids[{i}]={int(ids[i])}; "
            f"labels must repeat input_ids where trained (unshifted) and be {ignore_index} elsewhere"
        )
    num_trained = int(trained.sum())
    return PackSample(
        input_ids=ids,
        trained_mask=trained,
        group_id=index,
        advantages=np.ones(num_trained, np.float32),
        sampler_logprobs=np.zeros(num_trained, np.float32),
    )


@dataclass(kw_only=True, slots=True)
class SFTCollator:
    """`data_collator` of `transformers.Trainer` (or `collate_fn` of a DataLoader): a batch of tokenized SFT
    examples -> `{"packed_row": PackedRow, "input_ids": row.input_ids}`, every shared prefix stored once.

    `input_ids` is the row's forwarded tokens, so the Trainer's token counting
    (`include_num_input_tokens_seen`) and FLOP estimate see what is really computed."""

    token_budget: int = 0
    """Unique tokens per row; 0 = unbounded (the batch size bounds it). A batch over it raises `RowFullError`."""
    share_prefixes: bool = True
    """False: plain padding-free varlen packing, each example forwarded whole (the baseline)."""
    ignore_index: int = -100
    """The label of untrained tokens."""

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        row = TreeRow(self.token_budget, share_prefixes=self.share_prefixes)
        row.extend(_sample(feature, i, self.ignore_index) for i, feature in enumerate(features))
        packed: PackedRow = row.pack()
        return {"packed_row": packed, "input_ids": packed.input_ids}
