"""`random_grpo_groups`: seeded GRPO-shaped samples for benchmarks and tests (numpy only).

Owns the synthetic data shape: per prompt, `rollouts_per_prompt` samples sharing the prompt, some of
them multi-turn (assistant turns trained, tool replies not), some multi-turn rollouts forked the way
agrpo-rollout's reconcile forks them (a later turn re-renders history, so a second sample shares the
first one's tokens up to a divergence point inside its history, and trains only its own new turns).
Does not know packing; it only builds `PackSample`s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._sample import PackSample


@dataclass(kw_only=True, slots=True)
class GroupShape:
    """How random GRPO data looks. Lengths are inclusive (low, high) token ranges."""

    num_prompts: int = 64
    """Groups (one per prompt)."""
    rollouts_per_prompt: int = 8
    """Rollouts per group (`num_generations`)."""
    prompt_tokens: tuple[int, int] = (512, 2048)
    """Prompt length range."""
    completion_tokens: tuple[int, int] = (256, 4096)
    """Sampled tokens per rollout (all turns together)."""
    multi_turn_frac: float = 0.25
    """Fraction of rollouts with 2..`max_turns` assistant turns and tool replies between them."""
    max_turns: int = 3
    """Most assistant turns of a multi-turn rollout (>= 2)."""
    tool_tokens: tuple[int, int] = (16, 256)
    """Length range of one tool reply (untrained)."""
    fork_frac: float = 0.5
    """Fraction of multi-turn rollouts whose last turn re-renders history and forks a second sample."""
    vocab_size: int = 32000
    """Token ids are drawn uniformly from [0, vocab_size)."""
    sampler_top_k: int = 0
    """When > 0, every sample carries (T, K) sampler top ids and log-probs."""
    routed_experts: tuple[int, int, int] | None = None
    """(num_layers, top_k, num_experts): every sample carries MoE routes, a function of each token id (so
    shared tokens agree; no random draw, the token data of a seed is unchanged). None: no routes."""


def _turns(rng: np.random.Generator, shape: GroupShape) -> list[tuple[np.ndarray, bool]]:
    """A rollout after its prompt: (tokens, trained) pieces, assistant turns and tool replies."""
    total = int(rng.integers(shape.completion_tokens[0], shape.completion_tokens[1] + 1))
    turns = 1
    if shape.max_turns >= 2 and rng.random() < shape.multi_turn_frac:
        turns = int(rng.integers(2, shape.max_turns + 1))
    cuts = np.sort(rng.integers(1, max(total, 2), size=turns - 1))
    lengths = np.diff(np.concatenate([[0], cuts, [total]])).clip(min=1)
    pieces = []
    for t, length in enumerate(lengths):
        if t:
            tool = int(rng.integers(shape.tool_tokens[0], shape.tool_tokens[1] + 1))
            pieces.append((rng.integers(shape.vocab_size, size=tool), False))
        pieces.append((rng.integers(shape.vocab_size, size=int(length)), True))
    return pieces


def _sample(
    rng: np.random.Generator, ids: np.ndarray, mask: np.ndarray, group: int, shape: GroupShape
) -> PackSample:
    num_trained = int(mask.sum())
    top = {}
    if shape.sampler_top_k > 0:
        top_ids = rng.integers(shape.vocab_size, size=(num_trained, shape.sampler_top_k))
        top_logprobs = -np.sort(rng.exponential(size=(num_trained, shape.sampler_top_k)), axis=1)
        top = {"sampler_top_ids": top_ids, "sampler_top_logprobs": top_logprobs.astype(np.float32)}
    if shape.routed_experts is not None:
        top["routed_experts"] = token_routes(ids, *shape.routed_experts)
    return PackSample(
        input_ids=ids,
        trained_mask=mask,
        group_id=group,
        advantages=np.full(num_trained, rng.normal(), dtype=np.float32),
        sampler_logprobs=-rng.exponential(size=num_trained).astype(np.float32),
        **top,
    )


def token_routes(ids: np.ndarray, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """(L, num_layers, top_k) int16 routes that depend on the token id only: top_k distinct experts per
    layer (top_k <= num_experts), different per layer."""
    ids = np.asarray(ids, dtype=np.int64)[:, None, None]
    routes = (ids * 7 + np.arange(num_layers)[:, None] * 3 + np.arange(top_k)) % num_experts
    return routes.astype(np.int16)


def _rollout(rng: np.random.Generator, prompt: np.ndarray, group: int, shape: GroupShape) -> list[PackSample]:
    pieces = [(prompt, False), *_turns(rng, shape)]
    ids = np.concatenate([p for p, _ in pieces])
    mask = np.concatenate([np.full(p.shape[0], t) for p, t in pieces])
    samples = [_sample(rng, ids, mask, group, shape)]
    if len(pieces) > 3 and rng.random() < shape.fork_frac:
        # The last turn's prompt re-renders history: sequence A stops before the last tool reply, and B
        # shares A's tokens up to a point inside the history, then continues with drifted tokens.
        history = ids.shape[0] - pieces[-1][0].shape[0] - pieces[-2][0].shape[0]
        divergence = int(rng.integers(prompt.shape[0], history))
        drift = rng.integers(shape.vocab_size, size=int(rng.integers(1, 8)))
        tail = np.concatenate([drift, pieces[-2][0], pieces[-1][0]])
        fork_ids = np.concatenate([ids[:divergence], tail])
        fork_mask = np.zeros(fork_ids.shape[0], dtype=bool)
        fork_mask[-pieces[-1][0].shape[0] :] = True
        samples = [_sample(rng, ids[:history], mask[:history], group, shape)]
        samples.append(_sample(rng, fork_ids, fork_mask, group, shape))
    return samples


def random_grpo_groups(shape: GroupShape | None = None, *, seed: int = 0) -> list[PackSample]:
    """Samples of `shape.num_prompts` groups, group after group, reproducible from `seed`."""
    shape = shape or GroupShape()
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(shape.num_prompts):
        prompt = rng.integers(shape.vocab_size, size=int(rng.integers(*shape.prompt_tokens, endpoint=True)))
        for _ in range(shape.rollouts_per_prompt):
            samples += _rollout(rng, prompt, group, shape)
    return samples
