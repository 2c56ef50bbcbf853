"""The reference backend: tree attention written out segment by segment in plain PyTorch, fp32 math
(fp64 for fp64 inputs).

Owns the definition every fast backend is tested against (in fp32 also under autocast). It reads the
packing contract literally: segment s's queries attend to `kv_index[kv_offsets[s]:kv_offsets[s+1]]`,
causal aligned bottom-right. A sliding window W keeps the last W keys of that path (path index = depth =
position id, so a query at depth q sees depths q - W < p <= q, transformers' and vLLM's definition);
attention sinks (gpt-oss: one learned logit per query head) join each softmax as an extra column that
carries no value.
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
    supports_window = True
    supports_sinks = True
    input_dtypes = None
    forward_only_on = ()
    under_compile = "custom_op"

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def prepare(self, layout: TreeLayout, *, windows=(), sinks=False) -> object:
        return None

    def attend(
        self, query, key, value, layout: TreeLayout, state, *, scaling, softcap, window=None, sinks=None
    ):
        with torch.autocast(query.device.type, enabled=False):  # fp32 math even under autocast
            return self._attend(query, key, value, layout, scaling, softcap, window, sinks)

    def _attend(self, query, key, value, layout: TreeLayout, scaling, softcap, window, sinks):
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
            scores = scores.masked_fill(~_visible(*scores.shape[-2:], window, q.device), float("-inf"))
            outputs.append(_softmax(scores, sinks) @ v_s)
        out = torch.cat(outputs, dim=1).to(query.dtype)  # (Hq, N, D)
        return out.transpose(0, 1).unsqueeze(0)

    def attend_backward(
        self, grad, query, key, value, layout: TreeLayout, state, *, scaling, softcap, window=None, sinks=None
    ):
        """grad (1, N, Hq, D) of `attend`'s output -> (d query, d key, d value, d sinks), shaped and typed as the
        inputs (d sinks None without sinks)."""
        with torch.autocast(query.device.type, enabled=False):
            return self._backward(grad, query, key, value, layout, scaling, softcap, window, sinks)

    def _backward(self, grad, query, key, value, layout: TreeLayout, scaling, softcap, window, sinks):
        q, k, v, do = query[0], key[0], value[0], grad[0].transpose(0, 1)  # (H, N, D)
        heads_kv, groups = k.shape[0], q.shape[0] // k.shape[0]
        compute = torch.promote_types(query.dtype, torch.float32)
        dq = torch.zeros_like(q, dtype=compute)
        dk, dv = torch.zeros_like(k, dtype=compute), torch.zeros_like(v, dtype=compute)
        d_sinks = None if sinks is None else torch.zeros(q.shape[0], dtype=compute, device=q.device)
        q_off, kv_off = layout.q_offsets_host, layout.kv_offsets_host
        for s in range(layout.num_segments):
            path, rows = layout.kv_index[kv_off[s] : kv_off[s + 1]], slice(q_off[s], q_off[s + 1])
            k_s = k.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            v_s = v.index_select(1, path).repeat_interleave(groups, dim=0).to(compute)
            q_s, do_s = q[:, rows].to(compute), do[:, rows].to(compute)
            raw = q_s @ k_s.transpose(1, 2) * scaling
            capped = softcap * torch.tanh(raw / softcap) if softcap else raw
            num_q, num_k = raw.shape[-2:]
            probs = _softmax(
                capped.masked_fill(~_visible(num_q, num_k, window, q.device), float("-inf")), sinks
            )
            d_probs = do_s @ v_s.transpose(1, 2)
            # The sink's column has no value, so its d_prob is 0 and the softmax backward's sum runs over keys only.
            weighted = (d_probs * probs).sum(-1, keepdim=True)  # = do . out per query
            d_scores = probs * (d_probs - weighted)
            if (
                sinks is not None
            ):  # d sink = p_sink * (0 - do . out), p_sink = 1 - sum of the keys' probabilities
                d_sinks -= ((1 - probs.sum(-1, keepdim=True)) * weighted).sum((1, 2))
            if softcap:
                d_scores = d_scores * (1 - (capped / softcap) ** 2)
            dq[:, rows] = d_scores @ k_s * scaling
            dk_s = (d_scores.transpose(1, 2) @ q_s * scaling).view(heads_kv, groups, num_k, -1).sum(1)
            dv_s = (probs.transpose(1, 2) @ do_s).view(heads_kv, groups, num_k, -1).sum(1)
            dk.index_add_(1, path, dk_s)
            dv.index_add_(1, path, dv_s)
        grads = dq.to(query.dtype)[None], dk.to(key.dtype)[None], dv.to(value.dtype)[None]
        return *grads, None if sinks is None else d_sinks.to(sinks.dtype)


def _visible(num_q: int, num_k: int, window: int | None, device) -> torch.Tensor:
    """(num_q, num_k) bool: causal bottom-right on the path, and within the last `window` keys when windowed."""
    rows = torch.arange(num_q, device=device)[:, None] + (num_k - num_q)
    cols = torch.arange(num_k, device=device)[None, :]
    visible = cols <= rows
    return visible & (cols > rows - window) if window else visible


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the keys (H, q, k); with sinks (H,), each head's sink logit joins the normalisation."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
