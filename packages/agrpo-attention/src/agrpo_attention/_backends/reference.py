"""The reference backend: tree attention written out segment by segment in plain PyTorch, fp32 math
(fp64 for fp64 inputs).

Owns the definition every fast backend is tested against. It reads the packing contract literally:
segment s's queries attend to `kv_index[kv_offsets[s]:kv_offsets[s+1]]`, causal aligned bottom-right.
Runs on any device; costs one Python iteration per segment per layer and materialises each
segment's (Lq, Lk) score matrix, so it is for CPU training of small models and for tests. Does not
know the depth-first interval trick the flex backend uses (so the two check each other).
"""

from __future__ import annotations

import torch

from .._tree_layout import TreeLayout


class ReferenceBackend:
    """Per-segment softmax(Q K^T) V over gathered path keys; fp32 accumulation."""

    name = "reference"
    supports_softcap = True
    input_dtypes = None
    forward_only_on = ()

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def prepare(self, layout: TreeLayout) -> object:
        return None

    def attend(self, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
        q, k, v = query[0], key[0], value[0]  # (H, N, D)
        groups = q.shape[0] // k.shape[0]
        compute = torch.promote_types(query.dtype, torch.float32)
        q_off, kv_off = layout.q_offsets_host, layout.kv_offsets_host
        outputs = []
        for s in range(layout.num_segments):
            path = layout.kv_index[kv_off[s] : kv_off[s + 1]]
            k_s = k.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            v_s = v.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            scores = q[:, q_off[s] : q_off[s + 1]].to(compute) @ k_s.transpose(1, 2) * scaling
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            num_q, num_k = scores.shape[-2:]
            rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
            visible = torch.arange(num_k, device=q.device)[None, :] <= rows
            scores = scores.masked_fill(~visible, float("-inf"))
            outputs.append(torch.softmax(scores, dim=-1) @ v_s)
        out = torch.cat(outputs, dim=1).to(query.dtype)  # (Hq, N, D)
        return out.transpose(0, 1).unsqueeze(0)
