"""The Triton delta rule on CPU through Triton's interpreter, against the PyTorch rule: the cases' errors.

Run by the `triton_interpreter_cases` fixture (`conftest.py`, with `path_conv_triton_cases.py`) in a fresh
interpreter, because TRITON_INTERPRET must be set before triton is first imported (it is set here, first
thing); `python delta_rule_triton_cases.py` alone prints the same. `cases()` returns one dict: per case and tensor (output, final state, each gradient), the largest absolute difference
from the PyTorch rule run in fp64, divided by the largest absolute value of that fp64 result, for the
Triton kernels in fp32 (`triton`) and, as the yardstick, the PyTorch rule in fp32 (`torch`). Shapes are
small (2 CPU cores, the interpreter runs every program in numpy) but cross every masked edge: sequences
of 1, 64 and 65 tokens, head dims that are not powers of two, value heads grouped over key heads, and
more value columns than one tile.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json

import numpy as np
import torch

from agrpo_attention._delta_rule_torch import varlen_gated_delta_rule
from agrpo_attention._delta_rule_triton import triton_varlen_gated_delta_rule
from agrpo_attention._deltanet_plan import build_deltanet_plan
from agrpo_attention._tree_deltanet import tree_delta_rule
from agrpo_packing import PackSample, TreeRow

NAMES = ("out", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def random_inputs(num_tokens, num_states, *, seed, hk=1, hv=2, dk=24, dv=40):
    """fp64 leaves q/k (1, N, hk, dk), v (1, N, hv, dv), g/beta (1, N, hv), states (num_states, hv, dk, dv)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(1, num_tokens, hk, dk), rand(1, num_tokens, hk, dk), rand(1, num_tokens, hv, dv)
    g = -2 * torch.rand(1, num_tokens, hv, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, num_tokens, hv, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta, rand(num_states, hv, dk, dv)]


def errors(run, leaves, dtype) -> dict[str, list[float]]:
    """Values and gradients of `run` on `leaves` cast to `dtype` (fp64 = the truth) under fixed weights."""
    cast = [x.detach().to(dtype).requires_grad_() for x in leaves]
    outputs = run(*cast)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outputs]
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights, strict=True))
    grads = torch.autograd.grad(loss, cast, allow_unused=True)
    return [o.detach().double() for o in outputs] + [
        torch.zeros_like(x) if d is None else d.double() for x, d in zip(leaves, grads, strict=True)
    ]


def compare(run_torch, run_triton, leaves, names=NAMES) -> dict:
    truth = errors(run_torch, leaves, torch.float64)
    result = {}
    for label, run in (("torch", run_torch), ("triton", run_triton)):
        got = errors(run, leaves, torch.float32)
        scale = [max(t.abs().max().item(), 1e-30) for t in truth]
        result[label] = {
            n: (a - t).abs().max().item() / s for n, a, t, s in zip(names, got, truth, scale, strict=True)
        }
    return result


def varlen_case() -> dict:
    cu = (0, 1, 65, 129, 149)  # 1, 64 (one full chunk), 64 and 20 tokens, each from its own state
    leaves = random_inputs(cu[-1], len(cu) - 1, seed=0)

    def runner(kernel):
        def run(q, k, v, g, beta, h0):
            cu_t = torch.tensor(cu)
            return kernel(q, k, v, g, beta, cu_seqlens=cu_t, cu_seqlens_host=cu, initial_state=h0)

        return run

    return compare(runner(varlen_gated_delta_rule), runner(triton_varlen_gated_delta_rule), leaves)


def tree_row(sequences: list[list[int]]):
    row = TreeRow(0)
    for ids in sequences:
        mask = np.arange(len(ids)) > 0
        row.add(PackSample(input_ids=np.array(ids), trained_mask=mask, group_id=0,
                           advantages=np.ones(mask.sum()), sampler_logprobs=np.zeros(mask.sum())))  # fmt: skip
    return row.pack()


def tree_rows() -> dict:
    """The segment trees of GRPO rows: a single chain (one sequence, as in a plain row), a wide fork (one
    prompt, eight completions) and a deep fork (forks at four depths, one long branch)."""
    base = list(range(1, 71))  # 70 tokens: a root segment crossing one chunk boundary
    chain = [list(range(1, 141))]  # one sequence of three chunks, nothing shared
    wide = [base + [100 + c] * (1 + 3 * c) for c in range(8)]
    leaves = [(71, 81, 91, 1), (71, 81, 91, 2), (71, 81, 92, 1), (71, 82, 91, 1), (72, 81, 91, 1)]
    deep = [base[:10] + [a] * 5 + [b] * 3 + [c] * 4 + [d] * (1 + d) for a, b, c, d in leaves]
    deep.append(base[:10] + [71] * 70)  # a long branch under the first fork
    return {"chain": tree_row(chain), "wide": tree_row(wide), "deep": tree_row(deep)}


def tree_case(row) -> dict:
    plan = build_deltanet_plan(row, 4, "cpu")
    leaves = random_inputs(row.num_tokens, 0, seed=row.num_tokens, hk=2, hv=2, dk=16, dv=16)[:5]

    def runner(kernel):
        return lambda *x: (tree_delta_rule(*x, plan, kernel),)

    names = ("out", "dq", "dk", "dv", "dg", "dbeta")
    result = compare(runner("torch"), runner("triton"), leaves, names)
    return result | {"levels": len(plan.levels), "segments": row.num_segments}


def bf16_case() -> dict:
    """bf16 q/k/v as under autocast: output in bf16, final state fp32, the tf32 dot path; vs the PyTorch
    rule on the same bf16 values."""
    q, k, v, g, beta, h0 = random_inputs(70, 1, seed=2, hk=1, hv=1, dk=16, dv=16)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    kwargs = dict(cu_seqlens=torch.tensor([0, 70]), cu_seqlens_host=(0, 70), initial_state=h0.float())
    want_out, want_final = varlen_gated_delta_rule(q, k, v, g.float(), beta.float(), **kwargs)
    out, final = triton_varlen_gated_delta_rule(q, k, v, g.float(), beta.float(), **kwargs)
    return {"dtypes": [str(out.dtype), str(final.dtype)],
            "out": ((out.float() - want_out.float()).abs().max() / want_out.float().abs().max()).item(),
            "final": ((final - want_final).abs().max() / want_final.abs().max()).item()}  # fmt: skip


def compiled_case() -> dict:
    """torch.compile(fullgraph=True) traces through the custom op (fake shapes, registered autograd): its
    values and gradients equal the eager call's."""
    q, k, v, g, beta, h0 = (x.float() for x in random_inputs(40, 2, seed=3, hk=1, hv=1, dk=16, dv=16))
    cu = torch.tensor([0, 25, 40])

    def run(q, k, v, g, beta, h0):
        out, final = triton_varlen_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_host=(0, 25, 40), initial_state=h0
        )
        return out.sum() + (final * final).sum()

    results = []
    for fn in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        loss = fn(*leaves)
        results.append([loss.detach(), *torch.autograd.grad(loss, leaves)])
    return {"max_diff": max((a - b).abs().max().item() for a, b in zip(*results, strict=True))}


def opcheck_case() -> dict:
    """torch.library.opcheck of the forward op: schema, fake tensors, autograd registration, AOT dispatch; a
    two-level tree of three segments with grouped value heads and strided bf16 q/k (as the layer's views)."""
    from agrpo_attention._delta_rule_triton import _roots

    q, k, v, g, beta, h0 = random_inputs(30, 2, seed=4, hk=1, hv=2, dk=16, dv=16)
    qk = torch.cat([q[0], k[0]], dim=-1).bfloat16()  # (N, 1, 32): q and k are strided halves of one buffer
    tables = _roots(torch.tensor([0, 10, 30]), (0, 10, 30))
    leaves = [qk[..., :16], qk[..., 16:], v[0].float(), g[0].float(), beta[0].float(), h0.float()]
    leaves = [x.detach().requires_grad_() for x in leaves]
    fields = ("offsets", "parent", "child_offsets", "children", "level_segments", "level_offsets_host",
              "chunk_offsets", "chunk_table")  # fmt: skip
    args = (*leaves, *(getattr(tables, f) for f in fields), True)
    return torch.library.opcheck(torch.ops.agrpo.delta_rule_forward.default, args)


def cases() -> dict:
    found = {"varlen": varlen_case()}
    found |= {name: tree_case(row) for name, row in tree_rows().items()}
    return found | {"bf16": bf16_case(), "compiled": compiled_case(), "opcheck": opcheck_case()}


def main() -> None:
    print(json.dumps(cases()))


if __name__ == "__main__":
    main()
