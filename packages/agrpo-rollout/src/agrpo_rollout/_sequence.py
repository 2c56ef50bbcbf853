"""`TrainingSequence` and the reconcile step that builds them from a rollout's turns (SPEC F-REC).

Owns the rule that turns a chain of `TurnRecord`s into token sequences to train on. Does not know
HTTP, templates or advantages.

A rollout's turns are replayed in order. Each turn's prompt is compared with the tokens held so far:
- the prompt extends them (a clean boundary): its new tail is appended as context, then the turn's
  output is appended, sampled tokens trained;
- it does not (re-tokenisation drift, or a template that rewrites history, e.g. one that strips
  `<think>` from earlier turns): the held sequence is closed and a new one starts from the full new
  prompt. The two share every token up to the divergence point, so tree packing forwards that
  prefix once; `drift` = held tokens after the divergence point, the extra tokens the fork costs.
Tokens sampled with `output_mask` 0 are context. A sequence with no trained token is dropped.
Per-trained-token arrays (sampler log-probs, top log-probs, sampling masks) follow the trained
tokens in order, as `agrpo_packing.PackSample` expects.

MoE routes (routing replay) follow every token, and a token keeps the route of the first turn that
forwarded it. Why the first: the trainer forwards the whole sequence once, so each position gets one route,
while a later turn's request may report a held token again (with `routed_experts_prompt_start=0`). The two
reports serve different loss terms: the earlier one is the routing the earlier turn's own sampled tokens
were generated under, the later one is behind the KV the later turn's tokens attended to. They agree
whenever the later turn reused the earlier KV from vLLM's prefix cache (vLLM stores the routes with the
cached blocks and returns those: the usual case) and can differ only where it recomputed them (evicted
blocks, a partial last block, batch-dependent numerics); then one side's loss terms see a route their
sampler did not use, whichever is kept. Keeping the first makes every turn exact for the tokens it generated
itself, leaves only recomputed context inexact (counted in `ReconcileStats.route_conflicts`), lets a turn's
request skip the routes the rollout holds (vLLM's `routed_experts_prompt_start` exists for prompt tokens
"covered by earlier turns"; `Conversation.routes_from`), so the later turn reports only what the earlier
ones could not: the previous turn's last sampled token (never forwarded there) and the new context; and it is
the rule packing applies to tokens samples share. A fork shares the held routes up to the divergence point,
so both sequences agree on their common tokens. A sequence whose turns lack routes (not asked, or a custom
`generate_one_turn` that returns none) carries None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._routed_experts import merge_routes
from ._turn import TurnRecord


@dataclass(slots=True)
class TrainingSequence:
    """One token sequence to train on. L = tokens, T = trained tokens, K = sampler top log-probs."""

    input_ids: np.ndarray
    """(L,) int64 tokens: prompt, tool context and sampled tokens of one or more turns."""
    trained_mask: np.ndarray
    """(L,) bool, True at sampled tokens; False at index 0 (a prompt token)."""
    sampler_logprobs: np.ndarray
    """(T,) float32 log-prob the sampler gave each trained token."""
    sampler_top_ids: np.ndarray | None = None
    """(T, K) int64 top ids per trained token, -1 padded; None when a turn lacked them."""
    sampler_top_logprobs: np.ndarray | None = None
    """(T, K) float32 log-probs of `sampler_top_ids`, -inf padded."""
    sampling_mask: list[np.ndarray] | None = None
    """T int64 arrays of candidate ids; None when any turn lacked them (vocabulary normalisation)."""
    routed_experts: np.ndarray | None = None
    """(L, layers, top_k) int16 MoE route of every token, -1 where none; None when any turn lacked routes."""
    rollout_id: str = ""
    """The conversation it came from."""

    @property
    def num_trained(self) -> int:
        return int(self.sampler_logprobs.shape[0])


@dataclass(slots=True)
class ReconcileStats:
    """Turn boundaries of one rollout: how many forked and how many held tokens each re-rendered."""

    boundaries: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)
    """One entry per boundary, 0 for clean ones."""
    route_conflicts: int = 0
    """Held tokens a later turn reported another MoE expert set for (the first route is kept)."""


class _Builder:
    """Chunks of one sequence under construction."""

    def __init__(self, prompt: np.ndarray, routes: np.ndarray | None) -> None:
        self.ids = [prompt]
        self.mask = [np.zeros(prompt.shape[0], dtype=bool)]
        self.logprobs: list[np.ndarray] = []
        self.top_ids: list[np.ndarray] | None = []
        self.top_logprobs: list[np.ndarray] | None = []
        self.sampling: list[np.ndarray] | None = []
        self.routes: list[np.ndarray] | None = None if routes is None else [routes]
        self.length = int(prompt.shape[0])

    def held(self) -> np.ndarray:
        return np.concatenate(self.ids) if len(self.ids) > 1 else self.ids[0]

    def held_routes(self) -> np.ndarray | None:
        if self.routes is None:
            return None
        return np.concatenate(self.routes) if len(self.routes) > 1 else self.routes[0]

    def append_context(self, tokens: np.ndarray, turn: TurnRecord) -> int:
        """The new tail of `turn`'s prompt; held routes missing a token are filled from the turn's (the first
        route wins). Returns the held tokens whose route the turn reported differently."""
        held = self.length
        self.ids.append(tokens)
        self.mask.append(np.zeros(tokens.shape[0], dtype=bool))
        self.length += int(tokens.shape[0])
        if self.routes is None or turn.routed_experts is None:
            self.routes = None
            return 0
        merged, conflicts = merge_routes(self.held_routes(), turn.routed_experts[:held])
        self.routes = [merged, turn.routed_experts[held : self.length]]
        return conflicts

    def append_output(self, turn: TurnRecord) -> None:
        trained = turn.trained_mask
        self.ids.append(turn.output_ids)
        self.mask.append(trained)
        self.length += turn.num_output_tokens
        if self.routes is not None and turn.routed_experts is not None:
            self.routes.append(turn.routed_experts[turn.prompt_ids.shape[0] :])
        else:
            self.routes = None
        if not trained.any():
            return
        self.logprobs.append(turn.output_log_probs[trained])
        top = turn.output_sampler_logprobs
        if top is None or self.top_ids is None:
            self.top_ids = self.top_logprobs = None
        else:
            self.top_ids.append(top.ids[trained])
            self.top_logprobs.append(top.logprobs[trained])
        if turn.output_sampling_mask is None or self.sampling is None:
            self.sampling = None
        else:
            self.sampling.extend(m for m, t in zip(turn.output_sampling_mask, trained, strict=True) if t)

    def finish(self, rollout_id: str) -> TrainingSequence | None:
        if not self.logprobs:
            return None
        same_k = self.top_ids is not None and len({a.shape[1] for a in self.top_ids}) == 1
        return TrainingSequence(
            input_ids=np.concatenate(self.ids),
            trained_mask=np.concatenate(self.mask),
            sampler_logprobs=np.concatenate(self.logprobs),
            sampler_top_ids=np.concatenate(self.top_ids) if same_k else None,
            sampler_top_logprobs=np.concatenate(self.top_logprobs) if same_k else None,
            sampling_mask=self.sampling,
            routed_experts=self.held_routes(),
            rollout_id=rollout_id,
        )


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading tokens `a` and `b` share."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _fork_routes(previous: _Builder, turn: TurnRecord, matched: int) -> tuple[np.ndarray | None, int]:
    """Routes of a fork's prompt: the held routes of the `matched` shared tokens first (both sequences
    agree there), then the turn's own; and the shared tokens the turn routed differently."""
    routes = turn.routed_experts
    if routes is None:
        return None, 0
    prompt_routes = routes[: turn.prompt_ids.shape[0]]
    held = previous.held_routes()
    if held is None or not matched:
        return prompt_routes, 0
    shared, conflicts = merge_routes(held[:matched], prompt_routes[:matched])
    return np.concatenate([shared, prompt_routes[matched:]]), conflicts


def build_sequences(
    turns: Sequence[TurnRecord], rollout_id: str = ""
) -> tuple[list[TrainingSequence], ReconcileStats]:
    """Reconcile a rollout's turns into training sequences (see the module docstring)."""
    stats = ReconcileStats()
    builders: list[_Builder] = []
    for turn in turns:
        prompt = turn.prompt_ids
        if not builders:
            routes = None if turn.routed_experts is None else turn.routed_experts[: prompt.shape[0]]
            builders.append(_Builder(prompt, routes))
        else:
            held = builders[-1].held()
            matched = common_prefix_length(held, prompt)
            stats.boundaries += 1
            if matched == held.shape[0]:
                stats.drift_tokens.append(0)
                stats.route_conflicts += builders[-1].append_context(prompt[matched:], turn)
            else:
                stats.forks += 1
                stats.drift_tokens.append(int(held.shape[0] - matched))
                routes, conflicts = _fork_routes(builders[-1], turn, matched)
                stats.route_conflicts += conflicts
                builders.append(_Builder(prompt, routes))
        builders[-1].append_output(turn)
    sequences = [s for s in (b.finish(rollout_id) for b in builders) if s is not None]
    return sequences, stats
