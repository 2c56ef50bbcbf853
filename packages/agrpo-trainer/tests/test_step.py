"""The micro-batch loss and its normalisation: whatever micro-batches and ranks the step's samples land in,
every trained token weighs the same (SPEC F-LOSS). Parameters are float64; the reference attention backend
does its own math in float32, so rows packed differently agree to ~1e-9 absolute, not to the last bit: the
tolerance below is far from what a normalisation error would give (a factor of 2 or more)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_doubles import fixed_samples, rank_reward

from agrpo_attention import enable_tree_attention, token_scores
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackSample, TreeRow
from agrpo_trainer import AsyncGRPOConfig, ModelSetupError
from agrpo_trainer._loss import LossSettings
from agrpo_trainer._model import enable_routes, prepare_policy, router_aux_loss_coef
from agrpo_trainer._step import StepSettings, micro_batch_loss

CLOSE = {"rtol": 1e-5, "atol": 1e-7}
SETTINGS = StepSettings(
    loss=LossSettings(epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0, score_centering=True),
    temperature=1.0,
    router_aux_loss_coef=0.0,
    truncated_sampling=False,
)


@pytest.fixture(scope="module")
def model_and_samples():
    model = build_model(TinyModelSpec(seed=3), build_tokenizer()).double()
    samples = fixed_samples(model, num_prompts=4, seed=1)
    with torch.no_grad():  # move the policy off the sampler so ratios, clipping and masking all occur
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    enable_tree_attention(model, "reference")
    return model, [PackSample(**s.pack_fields()) for s in samples]


def _step_gradient(model, parts: list[list[list[PackSample]]]) -> torch.Tensor:
    """parts[rank][micro_batch] = samples; returns the gradient data-parallel training would apply."""
    total = sum(s.num_trained for rank in parts for mb in rank for s in mb)
    world = len(parts)
    summed = None
    for rank in parts:
        model.zero_grad()
        for micro_batch in rank:
            row = TreeRow(0)
            row.extend(micro_batch)
            loss, _ = micro_batch_loss(
                model,
                row.pack(),
                SETTINGS,
                step_trained_tokens=total,
                world_size=world,
                micro_batches_per_step=len(rank),
            )
            loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        summed = grad if summed is None else summed + grad
    return summed / world  # DDP/FSDP average gradients over ranks


def _split(items: list, pieces: int) -> list[list]:
    return [items[i::pieces] for i in range(pieces)]


def test_one_two_or_four_micro_batches_and_two_ranks_give_the_same_gradient(model_and_samples):
    model, samples = model_and_samples
    whole = _step_gradient(model, [[samples]])
    assert whole.abs().max() > 0
    for micro_batches in (2, 4):
        split = _step_gradient(model, [_split(samples, micro_batches)])
        torch.testing.assert_close(split, whole, **CLOSE)
    ranks = _step_gradient(model, [_split(half, 2) for half in _split(samples, 2)])
    torch.testing.assert_close(ranks, whole, **CLOSE)
    uneven = _step_gradient(model, [[samples[:1]], [samples[1:3], samples[3:]]])  # ranks of unequal size
    torch.testing.assert_close(uneven, whole, **CLOSE)


def test_an_empty_rank_still_forwards_so_collectives_line_up_and_adds_nothing(model_and_samples):
    model, samples = model_and_samples
    whole = _step_gradient(model, [[samples]])
    with_idle_rank = _step_gradient(model, [[samples], [[]]])
    torch.testing.assert_close(with_idle_rank * 2 / 2, whole, **CLOSE)
    model.zero_grad()
    loss, stats = micro_batch_loss(
        model, TreeRow(0).pack(), SETTINGS, step_trained_tokens=10, world_size=2, micro_batches_per_step=1
    )
    loss.backward()
    assert loss.item() == 0.0 and stats.metrics()["num_terms"] == 0
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # it did run a forward


def test_router_loss_weight_follows_the_config_and_refuses_dense_models():
    dense = build_model(TinyModelSpec(), build_tokenizer())
    assert router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ModelSetupError, match="leave router_aux_loss_coef=None"):
        router_aux_loss_coef(dense, 0.01)
    moe = build_model(TinyModelSpec(kind="moe"), build_tokenizer())
    moe.config.router_aux_loss_coef = 0.003
    assert router_aux_loss_coef(moe, None) == 0.003 and router_aux_loss_coef(moe, 0.05) == 0.05


def test_moe_router_loss_is_added_with_its_weight():

    moe = build_model(
        TinyModelSpec(kind="moe"), build_tokenizer()
    )  # float32: no float64 grouped expert matmul
    samples = [PackSample(**s.pack_fields()) for s in fixed_samples(moe, num_prompts=1)]
    enable_tree_attention(moe, "reference")
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    kwargs = {"step_trained_tokens": packed.num_loss_terms, "world_size": 1, "micro_batches_per_step": 2}
    plain, _ = micro_batch_loss(moe, packed, SETTINGS, **kwargs)
    with_router = StepSettings(
        **{**{f: getattr(SETTINGS, f) for f in SETTINGS.__slots__}, "router_aux_loss_coef": 0.5}
    )
    total, _ = micro_batch_loss(moe, packed, with_router, **kwargs)
    from agrpo_attention import token_scores

    aux = token_scores(moe, packed, router_aux_loss=True).aux_loss
    torch.testing.assert_close(total - plain, 0.5 * aux / 2)


def _own_routes(model, row) -> torch.Tensor:
    """(N, layers, 2) int16: the experts the model routes each packed token to, live."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        token_scores(model, row)
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, 1).to(torch.int16)


def test_route_agreement_is_a_step_metric_and_replay_changes_the_loss_only_when_on():
    moe = build_model(TinyModelSpec(kind="moe"), build_tokenizer())
    samples = [PackSample(**s.pack_fields()) for s in fixed_samples(moe, num_prompts=1)]
    enable_tree_attention(moe, "reference")
    enable_routes(moe, False)
    row = TreeRow(0)
    row.extend(samples)
    packed = row.pack()
    routes = _own_routes(moe, packed)
    others = [[e for e in range(4) if e not in pair] for pair in routes[:10, 0].tolist()]
    routes[:10, 0] = torch.tensor(
        others, dtype=torch.int16
    )  # the other two experts, for 10 tokens of layer 0
    routes[-1] = -1  # the last token has no route
    routed = dataclasses.replace(packed, routed_experts=routes)
    kwargs = {"step_trained_tokens": packed.num_loss_terms, "world_size": 1, "micro_batches_per_step": 2}
    plain, plain_stats = micro_batch_loss(moe, packed, SETTINGS, **kwargs)
    measured, stats = micro_batch_loss(moe, routed, SETTINGS, **kwargs)
    assert "moe/route_agreement" not in plain_stats.metrics()
    routed_pairs = 2 * (packed.num_tokens - 1)
    assert stats.metrics()["moe/route_agreement"] == (routed_pairs - 10) / routed_pairs
    assert torch.equal(measured, plain)  # replay off: the forward is unchanged
    merged = stats.merge(plain_stats).merge(stats).metrics()
    assert merged["moe/route_agreement"] == (routed_pairs - 10) / routed_pairs
    enable_routes(moe, True)
    replayed, replay_stats = micro_batch_loss(moe, routed, SETTINGS, **kwargs)
    assert replay_stats.metrics()["moe/route_agreement"] == stats.metrics()["moe/route_agreement"]
    assert not torch.equal(replayed, plain)


def test_routing_replay_is_refused_at_construction_on_a_dense_model(tmp_path):
    dense = build_model(TinyModelSpec(), build_tokenizer())
    args = AsyncGRPOConfig(output_dir=str(tmp_path), routing_replay=True, use_cpu=True)
    with pytest.raises(
        ModelSetupError, match="routing_replay=True: .*no mixture-of-experts layer.*routing_replay=False"
    ):
        prepare_policy(dense, args, None, build_tokenizer())
    enable_routes(dense, False)  # without replay a dense model is left as it is
    assert not hasattr(dense, "_agrpo_routing_replay")


@pytest.mark.server
def test_routing_replay_against_a_server_without_routes_is_refused_at_start_naming_the_flag(
    tmp_path, vllm_server
):
    """The real CPU server cannot return routes (no Model Runner V2): `train()` stops before any push or step,
    with the flag to add; the rollout config carries the policy's config, which routes are checked against."""
    from agrpo_rollout import ServerConfigError
    from agrpo_trainer import AsyncGRPOTrainer

    tokenizer = build_tokenizer()
    moe = build_model(TinyModelSpec(kind="moe", seed=2), tokenizer)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), routing_replay=True, use_cpu=True, bf16=False, vllm_server_base_url=vllm_server.url,
        weight_sync_backend="disk", max_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    assert args.return_routed_experts is True  # None follows routing_replay
    trainer = AsyncGRPOTrainer(moe, rank_reward, args=args,
                               train_dataset=[{"prompt": "x"}] * 4, processing_class=tokenizer)  # fmt: skip
    rollout = args.rollout_config(num_processes=1, policy=trainer.model)
    assert rollout.return_routed_experts and rollout.model_config["num_experts_per_tok"] == 2
    with pytest.raises(ServerConfigError, match="--enable-return-routed-experts"):
        trainer.train()
    assert trainer.state.global_step == 0
    with pytest.raises(ValueError, match="leave return_routed_experts unset"):
        AsyncGRPOConfig(
            output_dir=str(tmp_path), routing_replay=True, return_routed_experts=False, use_cpu=True
        )
