"""`agrpo_packing.testing`: public helpers for testing packing and anything that consumes `PackedRow`.

Owns the property-test data (`grpo_groups`, a hypothesis strategy; `random_grpo_groups`, seeded
numpy data of benchmark shape), the packing invariant as an assertion
(`assert_packed_logprobs_match`), the layout contract as an assertion (`assert_row_layout`) and the
per-token reference trie (`TokenTrieRow`). agrpo-attention's tests import these: they are public API.
`grpo_groups` needs `hypothesis` (`pip install agrpo-packing[testing]`), imported when called, so this
module imports without it. Does not know any model or attention backend: callers pass callables.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ._group_generator import GroupShape, random_grpo_groups
from ._packed_row import PackedRow
from ._row_invariants import assert_row_layout
from ._row_reference import SequenceLogprobs, reference_logprobs, unpack
from ._sample import PackSample
from ._token_trie import TokenTrieRow

__all__ = [
    "GroupShape",
    "TokenTrieRow",
    "assert_packed_logprobs_match",
    "assert_row_layout",
    "grpo_groups",
    "random_grpo_groups",
]

SEQUENCE_KINDS = ("completion", "multi_turn", "fork", "duplicate", "single_token", "untrained")
"""What one drawn sample of a group is; see `grpo_groups`."""


def _draw_sequence(
    draw, st, kind: str, prompt: list[int], group: list, tokens
) -> tuple[list[int], list[bool]]:
    if kind in ("fork", "duplicate") and group:
        ids, mask = draw(st.sampled_from(group))
        if kind == "duplicate":
            return list(ids), list(mask)
        cut = draw(st.integers(1, len(ids)))
        keep = mask[:cut] if draw(st.booleans()) else [False] * cut
        tool, completion = draw(tokens(0, 3)), draw(tokens(1, None))
        return ids[:cut] + tool + completion, keep + [False] * len(tool) + [True] * len(completion)
    if kind == "untrained":
        ids = draw(tokens(1, 3))
        return ids, [False] * len(ids)
    if kind == "single_token":
        return prompt + draw(tokens(1, 1)), [False] * len(prompt) + [True]
    first = draw(tokens(1, None))
    ids, mask = prompt + first, [False] * len(prompt) + [True] * len(first)
    if kind == "multi_turn":
        tool, second = draw(tokens(1, 3)), draw(tokens(1, None))
        ids, mask = ids + tool + second, mask + [False] * len(tool) + [True] * len(second)
    return ids, mask


ROUTE_SHAPE = (3, 2)
"""(num_layers, top_k) of the routes `grpo_groups(routes=True)` draws, expert ids in [0, 4)."""


def _routes(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """A sample's MoE routes for `grpo_groups(routes=True)`: a function of (token, depth), so shared
    prefixes agree, except that some samples carry none, some disagree at random tokens, and some leave
    random tokens without a route (-1)."""
    kind = rng.integers(6)
    if kind == 0:
        return None
    depth = np.arange(ids.shape[0])
    layer, slot = np.arange(ROUTE_SHAPE[0]), np.arange(ROUTE_SHAPE[1])
    routes = (ids[:, None, None] + depth[:, None, None] + layer[:, None] + 2 * slot) % 4
    picked = rng.random(ids.shape[0]) < 0.2
    if kind == 1:
        routes[picked] = (routes[picked] + 1) % 4
    elif kind == 2:
        routes[picked] = -1
    return routes.astype(np.int16)


def _pack_sample(
    ids, mask, group_id, rng, with_top: bool, with_mask: bool, vocab_size: int, with_routes: bool = False
) -> PackSample:
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    num_trained = int(mask.sum())
    extra = {}
    if with_routes:
        extra["routed_experts"] = _routes(ids, rng)
    if with_top:
        extra["sampler_top_ids"] = rng.integers(vocab_size, size=(num_trained, 2))
        extra["sampler_top_logprobs"] = -rng.exponential(size=(num_trained, 2)).astype(np.float32)
    if with_mask:
        extra["sampling_mask"] = [
            np.union1d(t, rng.choice(vocab_size, size=rng.integers(0, vocab_size + 1), replace=False))
            for t in ids[mask]
        ]
    return PackSample(
        input_ids=ids,
        trained_mask=mask,
        group_id=group_id,
        advantages=rng.normal(size=num_trained).astype(np.float32),
        sampler_logprobs=-rng.exponential(size=num_trained).astype(np.float32),
        **extra,
    )


def grpo_groups(
    *,
    max_groups: int = 3,
    max_rollouts: int = 5,
    max_prompt_tokens: int = 8,
    max_completion_tokens: int = 6,
    vocab_size: int = 3,
    sampler_data: bool = True,
    routes: bool = False,
):
    """Hypothesis strategy for `list[PackSample]`: random GRPO groups that stress prefix sharing.

    Each group has a prompt (all prompts start with a common drawn system prefix, possibly empty) and
    up to `max_rollouts` samples, each one of `SEQUENCE_KINDS`: a completion; a multi-turn sample
    (trained turn, untrained tool reply, trained turn); a fork of an earlier sample of the group cut at
    any point (partial shared history, its trained flags kept or turned to context) plus new tokens;
    an exact duplicate; a single trained token; a short sequence with nothing trained. A tiny
    `vocab_size` makes accidental sharing across groups common. Samples come group after group or
    shuffled. With `sampler_data`, all samples or none carry sampler top-2 data and sampling masks. With
    `routes`, samples carry MoE routes of `ROUTE_SHAPE` (some none, some conflicting, some partial).
    Token ids are in [0, vocab_size), so a model with that vocabulary can forward them."""
    from hypothesis import strategies as st

    def tokens(low: int, high: int | None):
        return st.lists(st.integers(0, vocab_size - 1), min_size=low, max_size=high or max_completion_tokens)

    @st.composite
    def groups(draw) -> list[PackSample]:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        with_top = sampler_data and draw(st.booleans())
        with_mask = sampler_data and draw(st.booleans())
        system = draw(tokens(0, 3))
        samples = []
        for group_id in range(draw(st.integers(1, max_groups))):
            prompt = system + draw(tokens(1, max_prompt_tokens))
            group: list[tuple[list[int], list[bool]]] = []
            for _ in range(draw(st.integers(1, max_rollouts))):
                group.append(
                    _draw_sequence(draw, st, draw(st.sampled_from(SEQUENCE_KINDS)), prompt, group, tokens)
                )
            samples += [
                _pack_sample(i, m, group_id, rng, with_top, with_mask, vocab_size, routes) for i, m in group
            ]
        if draw(st.booleans()):
            samples = [samples[i] for i in draw(st.permutations(range(len(samples))))]
        return samples

    return groups()


def assert_packed_logprobs_match(
    row: PackedRow,
    row_logprobs: Callable[[PackedRow], torch.Tensor],
    sequence_logprobs: SequenceLogprobs,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packing invariant: every loss term's log-prob from the packed forward equals the one from
    forwarding its sample alone.

    `row_logprobs(row) -> (M,)` is the packed forward's log-prob of each loss term's target;
    `sequence_logprobs(input_ids (L,)) -> (L - 1,)` gives log p(input_ids[i + 1] | input_ids[: i + 1]).
    Raises AssertionError naming the worst term (sample, position, target) on mismatch. Returns
    (packed, reference), both differentiable, so callers can compare gradients too."""
    packed = row_logprobs(row)
    if tuple(packed.shape) != (row.num_loss_terms,):
        raise AssertionError(
            f"row_logprobs returned shape {tuple(packed.shape)}, expected ({row.num_loss_terms},)"
        )
    reference = reference_logprobs(row, sequence_logprobs).to(device=packed.device, dtype=packed.dtype)
    close = torch.isclose(packed.detach(), reference.detach(), atol=atol, rtol=rtol)
    if not bool(close.all()):
        packed, reference = packed.detach(), reference.detach()
        error = (packed - reference).abs()
        worst = int(error.argmax())
        sample = int(row.sample_index[worst])
        depth = int(row.position_ids[row.token_index[worst]])
        raise AssertionError(
            f"{int((~close).sum())} of {row.num_loss_terms} loss terms differ from forwarding each sample alone "
            f"(atol={atol}, rtol={rtol}); worst: term {worst} of sample {sample}, predicted at depth {depth} "
            f"(packed position {int(row.token_index[worst])}), target {int(row.targets[worst])}: packed "
            f"{float(packed[worst]):.6g} vs alone {float(reference[worst]):.6g}. Samples of the row: "
            f"{[u.input_ids.tolist()[:16] for u in unpack(row)][:8]}"
        )
    return packed, reference
