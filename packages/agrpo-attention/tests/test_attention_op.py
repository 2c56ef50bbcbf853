"""Tree attention inside a compiled graph: the reference backend's custom op (`agrpo::tree_attention`) gives
the reference's output and autograd's gradients and passes torch's op checks; the GPU backends (torch
varlen, flex, adaptive) trace into one graph per kind of row without a graph break, for rows of any size.

The GPU kernels cannot run here, so the tracing test only traces: its dynamo backend counts the graphs it
is handed and returns a function that stops the call (`_Traced`) instead of running them on CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agrpo_attention import build_tree_plan
from agrpo_attention._attention_op import tree_attention_op
from agrpo_attention._backends import BACKENDS

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _qkv(n: int, *, seed: int, dtype=torch.float32, grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=dtype) for _ in range(2))
    return [x.requires_grad_(grad) for x in (q, k, v)]


@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (9, True)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("shared", [True, False])
def test_the_custom_op_is_the_reference_with_autograd_gradients(trees, shared, softcap, window, with_sinks):
    row = trees.shared_row() if shared else trees.random_row(3, share=False, vocab=512)
    layout = build_tree_plan(row, backend="reference").layout
    q, k, v = _qkv(row.num_tokens, seed=1)
    sinks = (
        torch.randn(4, generator=torch.Generator().manual_seed(3)).requires_grad_() if with_sinks else None
    )
    inputs = (q, k, v, sinks) if with_sinks else (q, k, v)
    grad = torch.randn(1, row.num_tokens, 4, 16, generator=torch.Generator().manual_seed(2))
    options = dict(scaling=0.25, softcap=softcap, window=window, sinks=sinks)
    want = BACKENDS["reference"].attend(q, k, v, layout, None, **options)
    want_grads = torch.autograd.grad(want, inputs, grad)
    got = tree_attention_op("reference", q, k, v, layout, **options)
    got_grads = torch.autograd.grad(got, inputs, grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_custom_op_passes_torchs_op_checks(trees):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch, as torch checks them."""
    row = trees.random_row(4, vocab=512)
    layout = build_tree_plan(row, backend="reference").layout
    q, k, v = _qkv(row.num_tokens, seed=3)
    tensors = (layout.q_offsets, layout.kv_index, layout.kv_offsets, layout.subtree_end, layout.host_offsets)
    op = torch.ops.agrpo.tree_attention.default
    torch.library.opcheck(op, (q, k, v, *tensors, "reference", 0.25, 0.0, 0, None))
    sinks = torch.randn(4, requires_grad=True)
    torch.library.opcheck(op, (q, k, v, *tensors, "reference", 0.25, 0.0, 7, sinks))


class _Traced(Exception):
    """Raised instead of running a traced graph (its kernels exist on CUDA only)."""


class _GraphCounter:
    """A dynamo backend that counts the graphs it is handed and never runs them."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        self.graphs.append(graph)

        def stop(*args):
            raise _Traced

        return stop


def _gpu_plan(row, name: str, monkeypatch):
    """`name`'s plan of `row` on CPU tensors, the backend's CUDA-only check skipped (nothing runs)."""
    from agrpo_attention._backends.varlen import VarlenBackend

    monkeypatch.setattr(VarlenBackend, "unavailable_reason", lambda self, device: None)
    plan = build_tree_plan(row, backend="reference")
    backend = BACKENDS[name]
    return dataclasses.replace(plan, backend=backend, attention_state=backend.prepare(plan.layout))


@pytest.mark.parametrize(("name", "most_graphs"), [("varlen", 2), ("flex", 1), ("adaptive", 3)])
def test_gpu_backends_trace_without_graph_breaks_into_one_graph_per_kind_of_row(
    trees, monkeypatch, name, most_graphs
):
    """varlen: rows that share nothing (no gather) and rows that share; flex: one; adaptive: both of varlen's
    and flex's (its choice per row). Twelve rows of different sizes, shared and plain, bf16 as under autocast,
    each longer than one flex block (a row of one 128-token block specialises its block count, 0/1
    specialisation: one graph more, for such short rows only)."""
    counter = _GraphCounter()
    attend = torch.compile(
        lambda q, k, v, plan: plan.attend(q, k, v, scaling=0.25),
        backend=counter,
        fullgraph=True,
        dynamic=True,
    )
    rows = [trees.random_row(seed, share=seed % 3 != 0, vocab=512, prompts=4) for seed in range(10)]
    rows += [trees.shared_row(prompt_tokens=130 + 10 * i, completions=6 + i) for i in range(2)]
    assert min(row.num_tokens for row in rows) > 128
    kinds = set()
    for row in rows:
        plan = _gpu_plan(row, name, monkeypatch)
        kinds.add(plan.layout.is_flat)
        with pytest.raises(_Traced):
            attend(*_qkv(row.num_tokens, seed=0, dtype=torch.bfloat16, grad=False), plan)
    assert kinds == {True, False}
    assert 1 <= len(counter.graphs) <= most_graphs
    kernels = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    if name != "flex":
        assert any("varlen_attn" in k for k in kernels), kernels
    if name != "varlen":
        assert any("flex_attention" in k for k in kernels), kernels


@pytest.mark.parametrize("name", ["flex", "adaptive"])
def test_windowed_layers_with_sinks_trace_without_graph_breaks_into_one_graph(trees, monkeypatch, name):
    """gpt-oss's layers under compile: a sliding window (its own block mask) and sinks (through flex's log-sum-exp)
    trace whole, and rows of every size reuse one graph (adaptive sends rows with sinks to flex)."""
    counter = _GraphCounter()
    sinks = torch.randn(4)
    attend = torch.compile(
        lambda q, k, v, plan: plan.attend(q, k, v, scaling=0.25, window=48, sinks=sinks),
        backend=counter,
        fullgraph=True,
        dynamic=True,
    )
    from agrpo_attention._backends.varlen import VarlenBackend

    monkeypatch.setattr(VarlenBackend, "unavailable_reason", lambda self, device: None)
    backend = BACKENDS[name]
    for seed in range(6):
        row = trees.random_row(seed, share=seed % 3 != 0, vocab=512, prompts=4)
        plan = build_tree_plan(row, backend="reference")
        state = backend.prepare(plan.layout, windows=(48,), sinks=True)
        plan = dataclasses.replace(plan, backend=backend, attention_state=state)
        with pytest.raises(_Traced):
            attend(*_qkv(row.num_tokens, seed=0, dtype=torch.bfloat16, grad=False), plan)
    assert len(counter.graphs) == 1
    kernels = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("flex_attention" in k for k in kernels) and not any("varlen" in k for k in kernels), kernels


def test_what_a_compiled_layer_is_handed_of_a_row_holds_no_python_sequence():
    """A compiled decoder layer receives the tree plan; dynamo guards a tuple or list field of it on its length
    (torch 2.11 did so for the layout's host offsets: a new graph for every segment count). Row-sized host
    data therefore lives in tensors, whose sizes are dynamic."""
    from agrpo_attention._tree_layout import TreeLayout
    from agrpo_attention._tree_plan import TreePlan

    for record in (TreeLayout, TreePlan):
        hints = {f.name: str(f.type) for f in dataclasses.fields(record)}
        sequences = {n: t for n, t in hints.items() if t.startswith(("tuple", "list", "Sequence"))}
        assert not sequences, f"{record.__name__}: {sequences}"
