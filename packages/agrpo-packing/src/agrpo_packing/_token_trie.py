"""`TokenTrieRow`: the straightforward per-token prefix trie, kept as the reference for `TreeRow`.

Owns nothing the product uses: tests check `TreeRow` against it (same nodes, same loss terms) and
`tools/bench/packing` times it as the baseline. One Python dict lookup per token on add and one loop
iteration per token on pack; about 0.3M raw tokens/s on one core, where `TreeRow` needs >= 5M. Keys are
(token, next token), like `TreeRow`, and the same tokens are forwarded (through each sample's last
trained token); only the order of siblings differs (insertion order here, key order there).
"""

from __future__ import annotations

import torch

from ._packed_row import PackedRow
from ._sample import PackSample


class _Node:
    __slots__ = ("children", "depth", "position", "token")

    def __init__(self, token: int, depth: int) -> None:
        self.token, self.depth, self.position = token, depth, -1
        self.children: dict[tuple[int, int], _Node] = {}


class TokenTrieRow:
    """A per-token trie row with `add` and `pack` like `TreeRow`, no budget."""

    def __init__(self) -> None:
        self.roots: dict[tuple[int, int], _Node] = {}
        self.num_nodes = 0
        self._samples: list[tuple[PackSample, list[_Node], list[int]]] = []

    def add(self, sample: PackSample) -> None:
        ids, trained = sample.input_ids.tolist(), sample.trained_mask.tolist()
        positions = [i for i, t in enumerate(trained) if t]
        children, path = self.roots, []
        for depth in range(positions[-1] if positions else 0):
            key = (ids[depth], ids[depth + 1])
            node = children.get(key)
            if node is None:
                node = children[key] = _Node(ids[depth], depth)
                self.num_nodes += 1
            path.append(node)
            children = node.children
        self._samples.append((sample, [path[i - 1] for i in positions], [ids[i] for i in positions]))

    def novel_nodes(self, sample: PackSample) -> int:
        """Nodes `add(sample)` would create (a per-token walk, like `add`)."""
        ids, trained = sample.input_ids.tolist(), sample.trained_mask.tolist()
        last = max((i for i, t in enumerate(trained) if t), default=0)
        children = self.roots
        for depth in range(last):
            node = children.get((ids[depth], ids[depth + 1]))
            if node is None:
                return last - depth
            children = node.children
        return 0

    def _layout(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Depth-first tokens and depths, segment starts and segment parents."""
        tokens, depths, starts, parents = [], [], [], []
        stack = [(node, -1) for node in reversed(self.roots.values())]
        while stack:
            node, parent_segment = stack.pop()
            starts.append(len(tokens))
            parents.append(parent_segment)
            while True:
                node.position = len(tokens)
                tokens.append(node.token)
                depths.append(node.depth)
                if len(node.children) != 1:
                    break
                (node,) = node.children.values()
            segment = len(starts) - 1
            stack += [(child, segment) for child in reversed(node.children.values())]
        return tokens, depths, starts, parents

    def pack(self) -> PackedRow:
        tokens, depths, starts, parents = self._layout()
        bounds = [*starts, len(tokens)]
        paths: list[list[int]] = []
        for segment, parent in enumerate(parents):
            own = list(range(bounds[segment], bounds[segment + 1]))
            paths.append((paths[parent] if parent >= 0 else []) + own)
        kv_offsets = [0]
        for path in paths:
            kv_offsets.append(kv_offsets[-1] + len(path))
        token_index, targets, sample_index = [], [], []
        for k, (_, nodes, target_ids) in enumerate(self._samples):
            token_index += [n.position for n in nodes]
            targets += target_ids
            sample_index += [k] * len(nodes)
        samples = [s for s, _, _ in self._samples]
        cat = (lambda xs: torch.cat(xs)) if samples else (lambda xs: torch.zeros(0))
        return PackedRow(
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            position_ids=torch.tensor(depths, dtype=torch.int64),
            q_offsets=torch.tensor(bounds, dtype=torch.int64),
            kv_index=torch.tensor([p for path in paths for p in path], dtype=torch.int64),
            kv_offsets=torch.tensor(kv_offsets, dtype=torch.int64),
            segment_parent=torch.tensor(parents, dtype=torch.int64),
            token_index=torch.tensor(token_index, dtype=torch.int64),
            targets=torch.tensor(targets, dtype=torch.int64),
            advantages=cat([torch.from_numpy(s.advantages) for s in samples]),
            sampler_logprobs=cat([torch.from_numpy(s.sampler_logprobs) for s in samples]),
            sample_index=torch.tensor(sample_index, dtype=torch.int64),
            num_samples=len(samples),
            num_raw_tokens=sum(s.num_tokens for s in samples),
        )
