"""The chunked gated delta rule against a token-by-token recurrence, in fp64, gradients included."""

from __future__ import annotations

import pytest
import torch

from agrpo_attention._delta_rule_torch import chunk_gated_delta_rule, varlen_gated_delta_rule


def recurrent_delta_rule(q, k, v, g, beta, state):
    """One sequence: q/k (T, Hk, dk), v (T, Hv, dv), g/beta (T, Hv), state (Hv, dk, dv) -> (out, state)."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q = q / q.norm(dim=-1, keepdim=True).square().add(1e-6).sqrt() * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).square().add(1e-6).sqrt()
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + torch.einsum("hk,hv->hkv", k[t], delta)
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outputs), state


def random_inputs(num_tokens, seed, hk=2, hv=4, dk=8, dv=6, decay=8.0):
    gen = torch.Generator().manual_seed(seed)
    shape = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = shape(1, num_tokens, hk, dk), shape(1, num_tokens, hk, dk), shape(1, num_tokens, hv, dv)
    g = -decay * torch.rand(1, num_tokens, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, num_tokens, hv, generator=gen, dtype=torch.float64)
    state = shape(1, hv, dk, dv)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 150])
def test_chunked_equals_recurrence_with_initial_state_and_gradients(num_tokens):
    q, k, v, g, beta, state = random_inputs(num_tokens, seed=num_tokens)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    want_out, want_final = recurrent_delta_rule(q[0], k[0], v[0], g[0], beta[0], state[0])
    torch.testing.assert_close(out[0], want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final[0], want_final, rtol=1e-10, atol=1e-10)
    w_out, w_final = torch.randn_like(out), torch.randn_like(final)
    inputs = (q, k, v, g, beta, state)
    got = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), inputs)
    want = torch.autograd.grad((want_out * w_out[0]).sum() + (want_final * w_final[0]).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_varlen_runs_each_sequence_from_its_own_state():
    lengths = [5, 70, 1, 33]
    q, k, v, g, beta, _ = random_inputs(sum(lengths), seed=3)
    states = torch.randn(len(lengths), 4, 8, 6, dtype=torch.float64)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    out, final = varlen_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=torch.tensor(cu), cu_seqlens_host=tuple(cu), initial_state=states
    )
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        pieces = (x[0, a:b] for x in (q, k, v, g, beta))
        want_out, want_final = recurrent_delta_rule(*pieces, states[i])
        torch.testing.assert_close(out[0, a:b], want_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[i], want_final, rtol=1e-10, atol=1e-10)
