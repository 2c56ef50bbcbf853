"""`tree_attention_forward`, the seam every backend is called through: under autocast it hands the backend
one low-precision dtype for q, k and v (fp32 master weights leave Qwen3's normed q/k in fp32 beside a bf16
v); without autocast a float32 row runs on a backend that runs float32 or is refused with its dtype named.

The GPU-only `varlen` kernel (also `adaptive`'s kernel for rows that share little) runs on CPU here through
the `cuda_like` fixture: a twin with FA2's contract that, like FA2, refuses float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agrpo_attention import UnsupportedModelError, build_tree_plan, enable_tree_attention, token_logprobs
from agrpo_attention._tree_attention import tree_attention_forward
from agrpo_packing.testing import assert_packed_logprobs_match

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def mixed_qkv(row, seed: int = 0):
    """fp32 q and k beside a bf16 v, as Qwen3 under autocast with fp32 weights hands them to attention."""
    gen = torch.Generator().manual_seed(seed)
    n = row.num_tokens
    q = torch.randn(1, 4, n, 16, generator=gen)
    k = torch.randn(1, 2, n, 16, generator=gen)
    v = torch.randn(1, 2, n, 16, generator=gen).to(torch.bfloat16)
    return q, k, v


def attend(plan, q, k, v):
    return tree_attention_forward(torch.nn.Identity(), q, k, v, None, scaling=0.25, tree_plan=plan)[0]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("backend", ["reference", "flex", "varlen", "adaptive"])
def test_autocast_hands_every_backend_one_low_precision_dtype(cuda_like, trees, backend, shared):
    row = trees.shared_row() if shared else trees.random_row(0, share=False, vocab=512)
    q, k, v = mixed_qkv(row)
    plan = build_tree_plan(row, backend=backend)
    want = build_tree_plan(row, backend="reference").attend(q, k, v.float(), scaling=0.25)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = attend(plan, q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("shared", [False, True])
def test_adaptive_runs_a_float32_row_without_autocast(cuda_like, trees, shared):
    """A true fp32 model: the rows `adaptive` gives to varlen (FA2 refuses float32) run through flex."""
    row = trees.shared_row() if shared else trees.random_row(1, share=False, vocab=512)
    q, k, v = (x.float() for x in mixed_qkv(row, seed=1))
    want = build_tree_plan(row, backend="reference").attend(q, k, v, scaling=0.25)
    with torch.no_grad():
        got = attend(build_tree_plan(row, backend="adaptive"), q, k, v)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_half_only_backend_refuses_float32_naming_the_dtype_and_the_fix(cuda_like, trees):
    row = trees.random_row(2, share=False, vocab=512)
    q, k, v = (x.float() for x in mixed_qkv(row))
    with pytest.raises(UnsupportedModelError, match=r"float32.*torch\.autocast.*backend='adaptive'"):
        attend(build_tree_plan(row, backend="varlen"), q, k, v)


def test_float32_qwen3_under_bf16_autocast_and_alone_through_adaptive(cuda_like, tiny_dense, trees):
    """The H200 failure on CPU: fp32 weights, adaptive picks varlen for an unshared row; trains under
    bf16 autocast (q/k come out of the fp32 norms in fp32) and runs in plain fp32 (through flex)."""
    model = copy.deepcopy(tiny_dense)
    assert next(model.parameters()).dtype == torch.float32
    assert enable_tree_attention(model, "adaptive") == "adaptive"
    row = trees.random_row(3, share=False, vocab=512)

    def stock(input_ids):
        logits = tiny_dense(input_ids=input_ids[None]).logits[0, :-1]
        return logits.double().log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs = token_logprobs(model, row)
    logprobs.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        assert_packed_logprobs_match(row, lambda r: logprobs.detach(), stock, atol=0.1, rtol=0)
        assert_packed_logprobs_match(row, lambda r: token_logprobs(model, r), stock, atol=1e-5, rtol=0)
