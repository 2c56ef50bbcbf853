"""The reference backend: tree attention written out segment by segment in plain PyTorch, fp32 math
(fp64 for fp64 inputs).

Owns the definition every fast backend is tested against (in fp32 also under autocast). It reads the
packing contract literally: segment s's queries attend to `kv_index[kv_offsets[s]:kv_offsets[s+1]]`,
causal aligned bottom-right.
Runs on any device; costs one Python iteration per segment per layer and materialises each
segment's (Lq, Lk) score matrix, so it is for CPU training of small models and for tests. Does not
know the depth-first interval trick the flex backend uses (so the two check each other).

Under torch.compile the per-segment loop would unroll into the graph (one graph per row shape), so the
compiled path calls it through agrpo's tree attention custom op (`under_compile = "custom_op"`), whose
backward is `attend_backward`: the same math differentiated by hand (softmax backward per segment, the
path gather's gradient scattered back with `index_add_`), checked against autograd of `attend` in tests.
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
    under_compile = "custom_op"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def prepare(self, layout: TreeLayout) -> object:
        return None

    def attend(self, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
        with torch.autocast(query.device.type, enabled=False):  # fp32 math even under autocast
            return self._attend(query, key, value, layout, scaling=scaling, softcap=softcap)

    def _attend(self, query, key, value, layout: TreeLayout, *, scaling, softcap):
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

    def attend_backward(self, grad, query, key, value, layout: TreeLayout, state, *, scaling, softcap):
        """grad (1, N, Hq, D) of `attend`'s output -> (d query, d key, d value), shaped and typed as the inputs."""
        with torch.autocast(query.device.type, enabled=False):
            return self._backward(grad, query, key, value, layout, scaling=scaling, softcap=softcap)

    def _backward(self, grad, query, key, value, layout: TreeLayout, *, scaling, softcap):
        q, k, v, do = query[0], key[0], value[0], grad[0].transpose(0, 1)  # (H, N, D)
        heads_kv, groups = k.shape[0], q.shape[0] // k.shape[0]
        compute = torch.promote_types(query.dtype, torch.float32)
        dq = torch.zeros_like(q, dtype=compute)
        dk, dv = torch.zeros_like(k, dtype=compute), torch.zeros_like(v, dtype=compute)
        q_off, kv_off = layout.q_offsets_host, layout.kv_offsets_host
        for s in range(layout.num_segments):
            path, rows = layout.kv_index[kv_off[s] : kv_off[s + 1]], slice(q_off[s], q_off[s + 1])
            k_s = k.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            v_s = v.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            q_s, do_s = q[:, rows].to(compute), do[:, rows].to(compute)
            raw = q_s @ k_s.transpose(1, 2) * scaling
            capped = softcap * torch.tanh(raw / softcap) if softcap else raw
            num_q, num_k = raw.shape[-2:]
            visible = torch.arange(num_k, device=q.device)[None, :] <= (
                torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
            )
            probs = torch.softmax(capped.masked_fill(~visible, float("-inf")), dim=-1)
            d_probs = do_s @ v_s.transpose(1, 2)
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
            if softcap:
                d_scores = d_scores * (1 - (capped / softcap) ** 2)
            dq[:, rows] = d_scores @ k_s * scaling
            dk_s = (d_scores.transpose(1, 2) @ q_s * scaling).view(heads_kv, groups, num_k, -1).sum(1)
            dv_s = (probs.transpose(1, 2) @ do_s).view(heads_kv, groups, num_k, -1).sum(1)
            dk.index_add_(1, path, dk_s)
            dv.index_add_(1, path, dv_s)
        return dq.to(query.dtype)[None], dk.to(key.dtype)[None], dv.to(value.dtype)[None]
