"""Routing replay on tiny Qwen3-MoE, OLMoE, Mixtral, Qwen3-Next and gpt-oss models, on CPU.

Replaying the model's own routes is bit-identical to live routing (fp32 and fp64, log-probs and every
gradient); replaying other routes matches a direct computation written here from the models' definitions
(a per-token loop over the chosen experts, gate weights from the softmax at those ids), with the packed
tree row against each sample forwarded alone through the stock model (fp64), and on a plain (unpacked, stock
attention) forward; tokens with -1 route live;
the router keeps a non-zero gradient; activation recompute and compiled layers use the same experts;
`replay=False` leaves the forward unchanged and measures agreement; bad routes and dense models are refused.
Routes of the packed row and of each sample alone come from one function of (depth, token, layer), so a
shared prefix token gets one route whichever sample it is read from.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint

from agrpo_attention import (
    UnsupportedModelError,
    enable_routing_replay,
    enable_tree_attention,
    token_logprobs,
    token_scores,
)
from agrpo_attention import _token_logprobs as token_logprobs_module
from agrpo_attention._routing_replay import RowRoutes
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackSample, TreeRow
from agrpo_packing.testing import GroupShape, assert_packed_logprobs_match, random_grpo_groups

FAMILIES = ("moe", "olmoe", "mixtral", "qwen3_next_moe", "gpt_oss")
NUM_EXPERTS, TOP_K = 4, 2


@pytest.fixture(autouse=True)
def live_rows_on_replaying_models_are_expected(monkeypatch):
    """Tests forward rows without routes through replaying models on purpose (the live side of a
    comparison): the once-per-process warning about it is marked as given; the tests of the warnings reset it."""
    monkeypatch.setattr(token_logprobs_module, "_warned_missing_routes", True)
    monkeypatch.setattr(token_logprobs_module, "_warned_unpatched_routes", False)


def stock_model(kind: str, dtype=torch.float32):
    """fp32 models run transformers' default experts kernel (grouped_mm); fp64 ones its eager loop, since
    grouped_mm has no fp64."""
    model = build_model(TinyModelSpec(kind=kind, num_layers=2, seed=3), build_tokenizer()).to(dtype)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


def replay_model(stock, *, replay: bool = True):
    model = copy.deepcopy(stock)
    enable_tree_attention(model, "reference")
    enable_routing_replay(model, replay=replay)
    return model


def grpo_row(seed: int = 0):
    """About 60-100 packed tokens: two prompts of three rollouts each."""
    shape = GroupShape(
        num_prompts=2, rollouts_per_prompt=3, prompt_tokens=(6, 14), completion_tokens=(2, 8), vocab_size=512
    )
    row = TreeRow(0)
    row.extend(random_grpo_groups(shape, seed=seed))
    return row.pack()


def routes_of(depth: torch.Tensor, ids: torch.Tensor, num_layers: int = 2) -> torch.Tensor:
    """(T, L, K) int16 routes, a function of (depth, token, layer) only; -1 for about a fifth of tokens."""
    layers = torch.arange(num_layers)[None, :]
    first = (ids[:, None] * 7 + depth[:, None] * 3 + layers * 5) % NUM_EXPERTS
    second = (first + 1 + (ids[:, None] + depth[:, None] + layers) % (NUM_EXPERTS - 1)) % NUM_EXPERTS
    routes = torch.stack([first, second], -1)
    routes[(ids + 2 * depth) % 5 == 0] = -1
    return routes.to(torch.int16)


def router_of(mlp):
    """The MoE block's router (`gate`; gpt-oss: `router`); None for a dense MLP."""
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)


def own_routes(model, row, forward=None) -> torch.Tensor:
    """(N, L, K) int16: the experts `model` routes each packed token to live (zeros for dense layers), in a
    tree forward of `row` (or `forward()`, a plain forward of N tokens)."""
    chosen = {}
    layers = model.model.layers
    hooks = [
        router_of(layer.mlp).register_forward_hook(lambda _m, _a, out, i=i: chosen.__setitem__(i, out[2]))
        for i, layer in enumerate(layers)
        if router_of(layer.mlp) is not None
    ]
    with torch.no_grad():
        token_logprobs(model, row) if forward is None else forward()
    for hook in hooks:
        hook.remove()
    num_tokens = row.num_tokens if forward is None else len(next(iter(chosen.values())))
    routes = torch.zeros(num_tokens, len(layers), TOP_K, dtype=torch.int16)
    for i, experts in chosen.items():
        routes[:, i] = experts.to(torch.int16)
    return routes


def logprobs_and_grads(model, row):
    model.zero_grad(set_to_none=True)
    scores = token_scores(model, row)
    weights = torch.linspace(-1, 1, row.num_loss_terms, dtype=scores.logprobs.dtype)
    (scores.logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", FAMILIES)
def test_replaying_the_models_own_routes_is_bit_identical_to_live_routing(kind, dtype):
    model = replay_model(stock_model(kind, dtype))
    row = grpo_row()
    live, live_grads = logprobs_and_grads(model, row)
    routes = own_routes(model, row)
    replayed, replayed_grads = logprobs_and_grads(model, dataclasses.replace(row, routed_experts=routes))
    assert torch.equal(replayed.logprobs, live.logprobs)
    assert live_grads.keys() == replayed_grads.keys()
    for name, grad in live_grads.items():
        assert torch.equal(replayed_grads[name], grad), name
    matching, routed = replayed.route_matches.tolist()
    assert matching == routed == row.num_tokens * len(enable_routing_replay(model).moe_layers)


def reference_gpt_oss_block(block, routes_TK: torch.Tensor):
    """gpt-oss's block computed directly: logits with the router's bias, the routed ids (live top-k where -1),
    softmax over those ids' logits alone; experts with biases, interleaved gate/up, clamped SwiGLU with
    `up + 1`."""
    router, experts = block.router, block.experts

    def forward(hidden_states):
        h_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits_TE = h_TH @ router.weight.T + router.bias
        experts_TK = torch.where(routes_TK >= 0, routes_TK, logits_TE.topk(TOP_K, -1).indices)
        weights_TK = torch.softmax(logits_TE.gather(1, experts_TK), -1)
        out_TH = torch.zeros_like(h_TH)
        for slot in range(TOP_K):
            e_T = experts_TK[:, slot]
            gate_up_T2I = (
                torch.einsum("th,tho->to", h_TH, experts.gate_up_proj[e_T]) + experts.gate_up_proj_bias[e_T]
            )
            gate_TI = gate_up_T2I[:, 0::2].clamp(max=experts.limit)
            up_TI = gate_up_T2I[:, 1::2].clamp(-experts.limit, experts.limit)
            act_TI = (up_TI + 1) * gate_TI * torch.sigmoid(experts.alpha * gate_TI)
            expert_TH = (
                torch.einsum("ti,tih->th", act_TI, experts.down_proj[e_T]) + experts.down_proj_bias[e_T]
            )
            out_TH = out_TH + weights_TK[:, slot, None] * expert_TH
        return out_TH.reshape(hidden_states.shape), weights_TK

    return forward


def reference_moe_block(block, routes_TK: torch.Tensor, kind: str):
    """The block's output computed directly: per token, its routed experts' weights gathered and applied (live
    top-k where -1), weighted by
    the softmax of the router logits at those ids (renormalised as the family does), plus Qwen3-Next's gated
    shared expert."""
    if kind == "gpt_oss":
        return reference_gpt_oss_block(block, routes_TK)

    def forward(hidden_states):
        h_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs_TE = torch.softmax((h_TH @ block.gate.weight.T).float(), -1)
        experts_TK = torch.where(routes_TK >= 0, routes_TK, probs_TE.topk(TOP_K, -1).indices)
        weights_TK = probs_TE.gather(1, experts_TK)
        if kind == "mixtral" or block.gate.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        weights_TK = weights_TK if kind == "mixtral" else weights_TK.to(h_TH.dtype)
        out_TH = torch.zeros_like(h_TH)
        for slot in range(TOP_K):  # each token's expert weights gathered: (T, 2I, H) and (T, H, I)
            gate_up_T2I = torch.einsum("toh,th->to", block.experts.gate_up_proj[experts_TK[:, slot]], h_TH)
            gate, up = gate_up_T2I.chunk(2, -1)
            down_THI = block.experts.down_proj[experts_TK[:, slot]]
            expert_TH = torch.einsum("thi,ti->th", down_THI, block.experts.act_fn(gate) * up)
            out_TH = out_TH + weights_TK[:, slot, None] * expert_TH
        if kind == "qwen3_next_moe":
            out_TH = out_TH + torch.sigmoid(block.shared_expert_gate(h_TH)) * block.shared_expert(h_TH)
        return out_TH.reshape(hidden_states.shape)

    return forward


def direct_sequence_logprobs(stock, kind: str):
    """A sample alone through the stock model whose MoE blocks run `reference_moe_block` with the sample's
    routes (`routes_of` its depths and tokens)."""

    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        routes = routes_of(torch.arange(input_ids.shape[0]), input_ids).to(torch.int64)
        for i, layer in enumerate(stock.model.layers):
            if router_of(layer.mlp) is not None:
                layer.mlp.forward = reference_moe_block(layer.mlp, routes[:, i], kind)
        logits = stock(input_ids=input_ids[None]).logits[0, :-1]
        return logits.log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]

    return sequence_logprobs


@pytest.mark.parametrize("kind", FAMILIES)
def test_packed_replay_equals_a_direct_computation_of_each_sample_alone_fp64(kind):
    stock = stock_model(kind, torch.float64)
    model = replay_model(stock)
    row = grpo_row(seed=1)
    routed = dataclasses.replace(row, routed_experts=routes_of(row.position_ids, row.input_ids))
    assert (routed.routed_experts[:, :, 0] == -1).any() and (routed.routed_experts[:, :, 0] >= 0).any()
    packed, direct = assert_packed_logprobs_match(
        routed, lambda r: token_logprobs(model, r), direct_sequence_logprobs(stock, kind), atol=1e-10, rtol=0
    )
    weights = torch.linspace(-1, 1, row.num_loss_terms, dtype=torch.float64)
    (packed * weights).sum().backward()
    (direct * weights).sum().backward()
    # the models compute gate weights in fp32 (softmax dtype=float) even in fp64, so gradients through them carry
    # fp32 rounding (3e-8 relative seen); a wrong expert would be off by O(1)
    for (name, p), (_, q) in zip(model.named_parameters(), stock.named_parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 1e-6 * q.grad.norm() + 1e-14, name
    assert not torch.equal(packed, token_logprobs(model, row))  # the routes changed something


def plain_sequence():
    """About 40 tokens of one sequence (longer than the gpt-oss model's sliding window of 16)."""
    return torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5))


def plain_logprobs_and_grads(model, input_ids, routes=None):
    """A plain forward (stock attention, one unpacked sequence, `moe_routes` as `token_scores` hands them):
    (next-token log-probs, parameter gradients of a fixed weighting of them, the routes' counts or None)."""
    model.zero_grad(set_to_none=True)
    row_routes = None if routes is None else RowRoutes(routes_NLK=routes.to(torch.int64))
    kwargs = {} if row_routes is None else {"moe_routes": row_routes}
    logits = model(input_ids=input_ids[None], use_cache=False, **kwargs).logits[0, :-1]
    logprobs = logits.log_softmax(-1).gather(1, input_ids[1:, None])[:, 0]
    (logprobs * torch.linspace(-1, 1, logprobs.shape[0], dtype=logprobs.dtype)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads, None if row_routes is None else row_routes.agreement_counts()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", FAMILIES)
def test_plain_forward_replay_of_the_models_own_routes_is_bit_identical_to_live_routing(kind, dtype):
    stock = stock_model(kind, dtype)
    model = copy.deepcopy(stock)
    settings = enable_routing_replay(model)
    input_ids = plain_sequence()
    routes = own_routes(stock, None, forward=lambda: stock(input_ids=input_ids[None], use_cache=False))
    live, live_grads, _ = plain_logprobs_and_grads(model, input_ids)
    replayed, replayed_grads, counts = plain_logprobs_and_grads(model, input_ids, routes)
    assert torch.equal(replayed, live)
    assert live_grads.keys() == replayed_grads.keys()
    for name, grad in live_grads.items():
        assert torch.equal(replayed_grads[name], grad), name
    assert counts.tolist() == [input_ids.shape[0] * len(settings.moe_layers)] * 2


@pytest.mark.parametrize("kind", FAMILIES)
def test_plain_forward_replay_equals_a_direct_computation_fp64(kind):
    stock = stock_model(kind, torch.float64)
    model = copy.deepcopy(stock)
    enable_routing_replay(model)
    input_ids = plain_sequence()
    routes = routes_of(torch.arange(input_ids.shape[0]), input_ids)
    replayed, grads, counts = plain_logprobs_and_grads(model, input_ids, routes)
    stock.zero_grad(set_to_none=True)
    direct = direct_sequence_logprobs(stock, kind)(input_ids)
    torch.testing.assert_close(replayed, direct.detach(), atol=1e-10, rtol=0)
    (direct * torch.linspace(-1, 1, direct.shape[0], dtype=direct.dtype)).sum().backward()
    for name, q in stock.named_parameters():  # fp32 gate weights in fp64 models: see the packed fp64 test
        assert (grads[name] - q.grad).norm() <= 1e-6 * q.grad.norm() + 1e-14, name
    routed = int((routes[:, list(enable_routing_replay(model).moe_layers), 0] >= 0).sum())
    assert counts[1] == routed and counts[0] < routed
    assert not torch.equal(
        replayed, plain_logprobs_and_grads(model, input_ids)[0]
    )  # the routes changed something


def tree_alone_logprobs(model):
    """A sample alone as a one-sample row through the tree model, with its own routes."""

    def sequence_logprobs(input_ids: torch.Tensor) -> torch.Tensor:
        trained = torch.ones(input_ids.shape[0], dtype=torch.bool)
        trained[0] = False
        zeros = torch.zeros(input_ids.shape[0] - 1).numpy()
        row = TreeRow(0)
        row.add(PackSample(input_ids=input_ids.numpy(), trained_mask=trained.numpy(), group_id=0,
                           advantages=zeros, sampler_logprobs=zeros))  # fmt: skip
        packed = row.pack()
        packed = dataclasses.replace(packed, routed_experts=routes_of(packed.position_ids, packed.input_ids))
        order = packed.position_ids[packed.token_index].argsort()
        return token_logprobs(model, packed)[order]

    return sequence_logprobs


def test_packed_tree_row_equals_each_sample_alone_with_its_own_routes_fp64():
    model = replay_model(stock_model("moe", torch.float64))
    row = grpo_row(seed=2)
    assert row.packing_ratio > 1.2  # prompts are shared
    routed = dataclasses.replace(row, routed_experts=routes_of(row.position_ids, row.input_ids))
    assert_packed_logprobs_match(routed, lambda r: token_logprobs(model, r), tree_alone_logprobs(model),
                                 atol=1e-10, rtol=0)  # fmt: skip


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_router_keeps_a_gradient_and_unrouted_tokens_route_live(kind):
    model = replay_model(stock_model(kind))
    row = grpo_row()
    _, grads = logprobs_and_grads(
        model, dataclasses.replace(row, routed_experts=routes_of(row.position_ids, row.input_ids))
    )
    routers = [n for n in grads if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers)
    unrouted = torch.full((row.num_tokens, 2, TOP_K), -1, dtype=torch.int16)
    live = token_scores(model, row)
    none_routed = token_scores(model, dataclasses.replace(row, routed_experts=unrouted))
    assert torch.equal(none_routed.logprobs, live.logprobs)
    assert none_routed.route_matches.tolist() == [0, 0]


def test_replay_off_keeps_the_forward_and_measures_agreement():
    stock = stock_model("moe")
    model = replay_model(stock, replay=False)
    row = grpo_row()
    routes = routes_of(row.position_ids, row.input_ids)
    scores = token_scores(model, dataclasses.replace(row, routed_experts=routes))
    assert torch.equal(scores.logprobs, token_scores(model, row).logprobs)
    matching, routed = scores.route_matches.tolist()
    assert routed == int((routes[:, :, 0] >= 0).sum()) and 0 < matching < routed
    own = token_scores(model, dataclasses.replace(row, routed_experts=own_routes(model, row)))
    assert own.route_matches.tolist() == [2 * row.num_tokens] * 2
    assert enable_routing_replay(model, replay=True).replay  # switching on later replays
    replayed = token_scores(model, dataclasses.replace(row, routed_experts=routes))
    assert not torch.equal(replayed.logprobs, scores.logprobs)


def test_activation_recompute_uses_the_replayed_experts():
    model = replay_model(stock_model("mixtral")).train()
    row = grpo_row()
    row = dataclasses.replace(row, routed_experts=routes_of(row.position_ids, row.input_ids))
    plain, plain_grads = logprobs_and_grads(model, row)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    recomputed, recomputed_grads = logprobs_and_grads(model, row)
    assert torch.equal(recomputed.logprobs, plain.logprobs)
    for name, grad in plain_grads.items():
        assert torch.equal(recomputed_grads[name], grad), name


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "gpt_oss"])
def test_a_compiled_checkpointed_layer_replays_in_one_graph_for_rows_of_any_size(kind):
    """The layer's class forward with its routes as kwargs, checkpointed, compiled fullgraph (so any graph
    break fails): same outputs and router gradients as eager; no recompile for rows of other sizes."""
    model = stock_model(kind)
    enable_routing_replay(model)
    layer = model.model.layers[1]  # a MoE layer (Qwen3-Next's layer 0 is dense; gpt-oss's is sliding)

    def region(hidden, cos, sin, routes, counts):
        return checkpoint(type(layer).forward, layer, hidden, position_embeddings=(cos, sin), attention_mask=None,
                          layer_routes=routes, layer_route_counts=counts, use_reentrant=False)  # fmt: skip

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(region, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for tokens in (9, 23):
        hidden = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
        cos, sin = model.model.rotary_emb(hidden, torch.arange(tokens)[None])
        routes = routes_of(torch.arange(tokens), torch.arange(tokens) * 3)[:, 1].to(torch.int64)
        results = []
        for run in (compiled, region):
            layer.zero_grad(set_to_none=True)
            counts = torch.zeros(2, dtype=torch.int64)
            out = run(hidden, cos, sin, routes, counts)
            out.square().sum().backward()
            results.append((out.detach(), router_of(layer.mlp).weight.grad.clone(), counts))
        (out, grad, counts), (eager_out, eager_grad, eager_counts) = results
        torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-6)
        assert (
            grad.abs().sum() > 0
            and torch.equal(counts, eager_counts)
            and counts[1] == (routes[:, 0] >= 0).sum()
        )
        frames.append(counter.frame_count)
    assert (
        frames[0] == frames[-1]
    )  # the first row's compile serves the others (the same count as without routes)


def test_dense_models_and_unsupported_moe_blocks_are_refused():
    with pytest.raises(UnsupportedModelError, match="no mixture-of-experts layer"):
        enable_routing_replay(stock_model("qwen3"))
    model = stock_model("moe")
    model.model.layers[0].mlp.gate.__class__ = type("OtherTopKRouter", (torch.nn.Module,), {})
    with pytest.raises(UnsupportedModelError, match="Qwen3MoeSparseMoeBlock"):
        enable_routing_replay(model)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r[:, :1], r"shape \(\d+, 1, 2\), expected .*num_hidden_layers"),
        (lambda r: r[:-1], r"expected \(N, num_hidden_layers, top_k\)"),
        (lambda r: r.index_fill(0, torch.tensor([3]), 4), r"outside \[0, 4\) \(largest 4\)"),
        (lambda r: r.index_fill(0, torch.tensor([3]), -2), r"outside \[0, 4\)"),
        (lambda r: torch.cat([r[:, :, :1], torch.full_like(r[:, :, 1:], -1)], -1), "some but not all"),
    ],
)
def test_bad_routes_are_refused_naming_the_fix(edit, message):
    model = replay_model(stock_model("moe"))
    row = grpo_row()
    routes = own_routes(model, row)
    with pytest.raises(ValueError, match=message):
        token_scores(model, dataclasses.replace(row, routed_experts=edit(routes)))


def test_dense_layer_columns_are_ignored():
    model = replay_model(stock_model("qwen3_next_moe"))
    row = grpo_row()
    routes = own_routes(model, row)
    routes[:, 0] = 99  # layer 0 is dense (mlp_only_layers): its column means nothing
    replayed = token_scores(model, dataclasses.replace(row, routed_experts=routes))
    assert torch.equal(replayed.logprobs, token_scores(model, row).logprobs)


def test_routes_on_an_unpatched_model_warn_once_and_route_live():
    model = stock_model("moe")
    enable_tree_attention(model, "reference")
    row = grpo_row()
    routed = dataclasses.replace(row, routed_experts=routes_of(row.position_ids, row.input_ids))
    with pytest.warns(RuntimeWarning, match="enable_routing_replay"):
        scores = token_scores(model, routed)
    assert scores.route_matches is None and torch.equal(scores.logprobs, token_scores(model, row).logprobs)


def test_the_readme_routing_replay_example_runs(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## MoE routing replay\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    names: dict = {"__name__": "readme"}
    exec(compile(code, "README.md", "exec"), names)
    assert "RoutingReplaySettings(replay=True" in capsys.readouterr().out
    assert names["model"].model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    matching, routed = names["scores"].route_matches.tolist()
    assert routed == 2 * (names["packed"].num_tokens - 1) and 0 <= matching < routed


def test_a_row_without_routes_on_a_replaying_model_warns_once_and_routes_live(monkeypatch):
    monkeypatch.setattr(token_logprobs_module, "_warned_missing_routes", False)
    model = replay_model(stock_model("olmoe"))
    row = grpo_row()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token_scores(model, row)  # an evaluation forward (eval mode): nothing to warn about
    model.train()
    with pytest.warns(RuntimeWarning, match="routing replay is on but a row carries no routed_experts"):
        scores = token_scores(model, row)
    assert scores.route_matches is None
    enable_routing_replay(model, replay=False)
    assert torch.equal(scores.logprobs, token_scores(model, row).logprobs)
