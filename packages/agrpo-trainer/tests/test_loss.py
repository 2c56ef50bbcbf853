"""`grpo_loss` against direct computations: case-by-case formulas per token, plain loops, and the exact
expectation over a categorical policy for score centering. Float64 where exactness matters."""

from __future__ import annotations

import math

import pytest
import torch

from agrpo_trainer._loss import LossInputs, LossSettings, LossStats, grpo_loss

F64 = torch.float64


def loss_settings(**overrides) -> LossSettings:
    values = dict(epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=2.0, score_centering=False)
    return LossSettings(**(values | overrides))


def reference_term(logp: float, logq: float, advantage: float, s: LossSettings) -> tuple[float, float]:
    """(loss, d loss / d logp) of one term, case by case."""
    r = math.exp(logp - logq) if logp - logq < 700 else math.inf
    if not s.is_clip_min <= r <= s.is_clip_max or advantage == 0:
        return 0.0, 0.0
    if advantage > 0:
        return -advantage * min(r, 1 + s.epsilon_high), (-advantage * r if r <= 1 + s.epsilon_high else 0.0)
    return -advantage * max(r, 1 - s.epsilon), (-advantage * r if r >= 1 - s.epsilon else 0.0)


def terms_from_ratios(ratios: list[float], advantages: list[float], seed: int = 0):
    """Leaf policy log-probs whose ratio to random sampler log-probs is exactly `ratios`."""
    logq = -torch.rand(len(ratios), dtype=F64, generator=torch.Generator().manual_seed(seed)) * 3
    logp = (logq + torch.tensor(ratios, dtype=F64).log()).requires_grad_()
    return logp, logq, torch.tensor(advantages, dtype=F64)


def check_against_reference(logp, logq, advantages, s, **extra) -> torch.Tensor:
    out = grpo_loss(
        LossInputs(policy_logprobs=logp, sampler_logprobs=logq, advantages=advantages, **extra), s
    )
    (grad,) = torch.autograd.grad(out.loss_sum, logp)
    want = [
        reference_term(p, q, a, s)
        for p, q, a in zip(logp.tolist(), logq.tolist(), advantages.tolist(), strict=True)
    ]
    assert out.loss_sum.item() == pytest.approx(sum(v for v, _ in want), abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([g for _, g in want], dtype=F64), atol=1e-12, rtol=0)
    return grad


def test_clipped_surrogate_both_signs_in_and_out_of_the_clip_region():
    s = loss_settings(is_clip_min=0.0, is_clip_max=1e9)  # no masking: clipping alone
    ratios = [0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 3.0]
    logp, logq, advantages = terms_from_ratios(ratios * 2, [1.3] * 7 + [-0.7] * 7)
    grad = check_against_reference(logp, logq, advantages, s)
    clipped = torch.tensor([r > 1.28 for r in ratios] + [r < 0.8 for r in ratios])
    assert (grad[clipped] == 0).all() and (grad[~clipped] != 0).all()


def test_masked_importance_sampling_drops_out_of_bound_terms_and_counts_them():
    s = loss_settings()
    ratios = [0.3, 0.49, 0.51, 1.0, 1.99, 2.01, 50.0]
    logp, logq, advantages = terms_from_ratios(ratios, [1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    logq = torch.cat([logq, torch.tensor([-1e4], dtype=F64)])  # a ratio of exp(1e4) = inf
    logp = torch.cat([logp.detach(), torch.tensor([-1.0], dtype=F64)]).requires_grad_()
    advantages = torch.cat([advantages, torch.ones(1, dtype=F64)])
    grad = check_against_reference(logp, logq, advantages, s)
    out_of_bounds = torch.tensor([True, True, False, False, False, True, True, True])
    assert (grad[out_of_bounds] == 0).all() and torch.isfinite(grad).all()
    stats = grpo_loss(LossInputs(policy_logprobs=logp, sampler_logprobs=logq, advantages=advantages), s).stats
    assert stats.metrics()["sampling/masked_mean"] == 5 / 8


def test_log_probs_are_renormalised_over_the_candidate_sets():
    s = loss_settings(score_centering=True)
    generator = torch.Generator().manual_seed(1)
    set_lse = -torch.rand(6, dtype=F64, generator=generator).requires_grad_()  # log of each set's mass
    logp = (-torch.rand(6, dtype=F64, generator=generator) * 2).requires_grad_()
    logq = (logp.detach() - set_lse.detach()) - torch.tensor([0.9, 0.1, -0.1, 0.5, 0.0, -0.3], dtype=F64)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.0], dtype=F64)
    out = grpo_loss(
        LossInputs(
            policy_logprobs=logp, sampler_logprobs=logq, advantages=advantages, candidate_logsumexp=set_lse
        ),
        s,
    )
    grad_logp, grad_lse = torch.autograd.grad(out.loss_sum, (logp, set_lse))
    want = [
        reference_term(p - c, q, a, s)
        for p, c, q, a in zip(
            logp.tolist(), set_lse.tolist(), logq.tolist(), advantages.tolist(), strict=True
        )
    ]
    assert out.loss_sum.item() == pytest.approx(sum(v for v, _ in want), abs=1e-12)
    torch.testing.assert_close(grad_logp, torch.tensor([g for _, g in want], dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_lse, -grad_logp)
    # top-K log-probs are renormalised by the same set: the same as passing renormalised inputs
    top = (-torch.rand(6, 3, dtype=F64, generator=generator) - 1).requires_grad_()
    sampler_top = top.detach() - set_lse.detach()[:, None] - 0.1
    with_sets = grpo_loss(
        LossInputs(
            policy_logprobs=logp,
            sampler_logprobs=logq,
            advantages=advantages,
            candidate_logsumexp=set_lse,
            policy_top_logprobs=top,
            sampler_top_logprobs=sampler_top,
        ),
        s,
    )
    renormalised = grpo_loss(
        LossInputs(
            policy_logprobs=logp - set_lse,
            sampler_logprobs=logq,
            advantages=advantages,
            policy_top_logprobs=top - set_lse[:, None],
            sampler_top_logprobs=sampler_top,
        ),
        s,
    )
    grads = torch.autograd.grad(with_sets.loss_sum, (logp, top, set_lse))
    torch.testing.assert_close(grads, torch.autograd.grad(renormalised.loss_sum, (logp, top, set_lse)))


def test_score_centering_adds_the_kept_top_k_mass_gradient_and_keeps_the_loss_value():
    s = loss_settings(score_centering=True)
    logp, logq, advantages = terms_from_ratios([1.0, 3.0, 0.9, 1.1], [1.0, 1.0, -2.0, 0.5])
    # top-K ratios: in bounds, masked (3.0, 0.2), clipped for A > 0 (1.5) or A < 0 (0.7), and a -1 pad
    top_ratios = torch.tensor([[1.0, 1.5, 3.0], [0.9, 0.2, 1.0], [0.7, 1.5, 1.0], [1.2, 1.0, 1.0]], dtype=F64)
    sampler_top = torch.log(torch.tensor([[0.3, 0.2, 0.1], [0.4, 0.3, 0.2], [0.5, 0.2, 0.1], [0.6, 0.1, 1]]))
    sampler_top = sampler_top.to(F64)
    sampler_top[3, 2] = -torch.inf
    top = (sampler_top + top_ratios.log()).requires_grad_()
    inputs = dict(policy_logprobs=logp, sampler_logprobs=logq, advantages=advantages)
    centered = grpo_loss(LossInputs(**inputs, policy_top_logprobs=top, sampler_top_logprobs=sampler_top), s)
    plain = grpo_loss(LossInputs(**inputs), loss_settings())
    assert centered.loss_sum.item() == pytest.approx(plain.loss_sum.item(), abs=1e-12)
    grad_logp, grad_top = torch.autograd.grad(centered.loss_sum, (logp, top))
    (plain_grad_logp,) = torch.autograd.grad(plain.loss_sum, logp)
    torch.testing.assert_close(grad_logp, plain_grad_logp)
    want = torch.zeros(4, 3, dtype=F64)
    for m, a in enumerate(advantages.tolist()):
        for k in range(3):
            r = top_ratios[m, k].item()
            unclipped = r <= 1.28 if a > 0 else r >= 0.8
            if math.isfinite(sampler_top[m, k]) and 0.5 <= r <= 2.0 and unclipped:
                want[m, k] = a * math.exp(top[m, k].item())  # d/d logp_k of A pi(k)
    torch.testing.assert_close(grad_top, want, atol=1e-15, rtol=0)
    assert (want != 0).sum() == 7 and grad_top[1].abs().sum() > 0  # the masked sampled term is centred too


# A categorical policy over V = 8 tokens and a different sampler: token 0 is outside the IS bounds
# (r = 3.25), token 1 is clipped for A > 0 (r = 1.35), the other ratios lie in [0.54, 0.74].
PI = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.06, 0.05, 0.04], dtype=F64)
MU = PI * torch.tensor([0.25, 0.6, 1.1, 1.2, 1.3, 1.2, 1.4, 1.5], dtype=F64)
MU = MU / MU.sum()


def expected_gradient(theta: torch.Tensor, advantage: float, top_ids: list[int], centering: bool):
    """sum_y mu(y) d loss(y) / d theta, exactly: one loss term per possible sampled token y."""
    theta = theta.detach().requires_grad_()
    logp = theta.log_softmax(0)
    s = loss_settings(score_centering=centering)
    expectation = 0
    for y in range(8):
        out = grpo_loss(
            LossInputs(
                policy_logprobs=logp[y : y + 1],
                sampler_logprobs=MU.log()[y : y + 1],
                advantages=torch.full((1,), advantage, dtype=F64),
                policy_top_logprobs=logp[top_ids][None],
                sampler_top_logprobs=MU.log()[top_ids][None],
            ),
            s,
        )
        expectation = expectation + MU[y] * out.loss_sum
    return torch.autograd.grad(expectation, theta)[0]


def kl_sampler_policy(theta: torch.Tensor) -> float:
    return float((MU * (MU.log() - theta.log_softmax(0))).sum())


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_score_centering_zeroes_the_expected_gradient_of_a_constant_advantage(advantage):
    theta = PI.log()
    ratios = PI / MU
    assert ratios[0] > 2.0 and 1.28 < ratios[1] <= 2.0 and (ratios[2:] >= 0.5).all()
    everything = list(range(8))
    plain = expected_gradient(theta, advantage, everything, centering=False)
    assert plain.abs().max() > 1e-2
    if advantage > 0:  # the constant advantage pulls the policy toward the sampler
        assert kl_sampler_policy(theta - 0.1 * plain) < kl_sampler_policy(theta) - 1e-3
    centered = expected_gradient(theta, advantage, everything, centering=True)
    assert centered.abs().max() < 1e-6


def test_score_centering_over_fewer_ids_leaves_the_mass_outside_the_top_k():
    theta = PI.log().requires_grad_()
    top_ids = [2, 4, 3, 0, 1]  # the sampler's five likeliest; in-bounds unclipped tokens 5, 6, 7 are left out
    residual = expected_gradient(theta, 1.0, top_ids, centering=True)
    (want,) = torch.autograd.grad(-theta.softmax(0)[[5, 6, 7]].sum(), theta)
    torch.testing.assert_close(residual, want, atol=1e-12, rtol=0)
    assert want.abs().max() > 1e-2


def random_inputs(num_terms: int, seed: int) -> LossInputs:
    generator = torch.Generator().manual_seed(seed)
    logq = -torch.rand(num_terms, dtype=F64, generator=generator) * 3
    sampler_top = (
        (-torch.rand(num_terms, 4, dtype=F64, generator=generator) * 4).sort(1, descending=True).values
    )
    sampler_top[::3, 2:] = -torch.inf
    return LossInputs(
        policy_logprobs=logq + torch.randn(num_terms, dtype=F64, generator=generator) * 0.6,
        sampler_logprobs=logq,
        advantages=torch.randn(num_terms, dtype=F64, generator=generator),
        policy_top_logprobs=sampler_top + torch.randn(num_terms, 4, dtype=F64, generator=generator) * 0.3,
        sampler_top_logprobs=sampler_top,
    )


def test_metrics_match_direct_formulas():
    s = loss_settings()
    inputs = random_inputs(40, seed=2)
    metrics = grpo_loss(inputs, s).stats.metrics()
    rows = list(
        zip(
            inputs.policy_logprobs.tolist(),
            inputs.sampler_logprobs.tolist(),
            inputs.advantages.tolist(),
            strict=True,
        )
    )
    ratios = [math.exp(p - q) for p, q, _ in rows]
    inside = [0.5 <= r <= 2.0 for r in ratios]
    low = sum(i and a < 0 and r < 0.8 for i, r, (_, _, a) in zip(inside, ratios, rows, strict=True))
    high = sum(i and a > 0 and r > 1.28 for i, r, (_, _, a) in zip(inside, ratios, rows, strict=True))
    masses = [sum(math.exp(v) for v in row) for row in inputs.sampler_top_logprobs.tolist()]
    want = {
        "num_terms": 40,
        "sampling/masked_mean": inside.count(False) / 40,
        "sampling/importance_sampling_ratio/mean": sum(ratios) / 40,
        "sampling/importance_sampling_ratio/min": min(ratios),
        "sampling/importance_sampling_ratio/max": max(ratios),
        "sampling/sampling_logp_difference/mean": sum(abs(p - q) for p, q, _ in rows) / 40,
        "sampling/sampling_logp_difference/max": max(abs(p - q) for p, q, _ in rows),
        "sampling/sampler_mass": sum(masses) / 40,
        "clip_ratio/low_mean": low / 40,
        "clip_ratio/high_mean": high / 40,
        "clip_ratio/region_mean": (low + high) / 40,
        "kl": sum(r - 1 - math.log(r) for r in ratios) / 40,
    }
    assert metrics == pytest.approx(want, abs=1e-12)
    assert low > 0 and high > 0 and 0 < inside.count(False) < 40


def halves(inputs: LossInputs, cut: int) -> tuple[LossInputs, LossInputs]:
    def part(sl):
        return LossInputs(
            **{
                name: getattr(inputs, name)[sl]
                for name in (
                    "policy_logprobs",
                    "sampler_logprobs",
                    "advantages",
                    "policy_top_logprobs",
                    "sampler_top_logprobs",
                )
            }
        )

    return part(slice(None, cut)), part(slice(cut, None))


def test_stats_of_two_halves_merge_and_all_reduce_to_those_of_the_whole():
    s = loss_settings(score_centering=True)
    inputs = random_inputs(30, seed=3)
    whole = grpo_loss(inputs, s)
    first, second = (grpo_loss(part, s) for part in halves(inputs, 11))
    merged = LossStats.empty().merge(first.stats).merge(second.stats)
    assert merged.metrics() == pytest.approx(whole.stats.metrics(), abs=1e-12)
    assert (first.loss_sum + second.loss_sum).item() == pytest.approx(whole.loss_sum.item(), abs=1e-12)
    # an all-reduce over two ranks: SUM the first tensor, MAX the second
    (sums_a, maxima_a), (sums_b, maxima_b) = first.stats.to_tensors(), second.stats.to_tensors()
    reduced = LossStats.from_tensors(sums_a + sums_b, torch.maximum(maxima_a, maxima_b))
    assert reduced.metrics() == pytest.approx(whole.stats.metrics(), abs=1e-12)


def test_no_terms_give_a_zero_loss_and_zero_metrics():
    empty = LossInputs(
        policy_logprobs=torch.zeros(0, requires_grad=True),
        sampler_logprobs=torch.zeros(0),
        advantages=torch.zeros(0),
    )
    out = grpo_loss(empty, loss_settings())
    out.loss_sum.backward()
    assert out.loss_sum.item() == 0.0
    assert set(out.stats.metrics().values()) == {0.0}
    assert LossStats.empty().merge(out.stats).metrics() == out.stats.metrics()


def test_bad_settings_and_unpaired_top_inputs_name_the_fix():
    with pytest.raises(ValueError, match="epsilon in"):
        loss_settings(epsilon=1.0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min <="):
        loss_settings(is_clip_min=3.0)
    inputs = random_inputs(3, seed=4)
    inputs.sampler_top_logprobs = None
    with pytest.raises(ValueError, match="pass both"):
        grpo_loss(inputs, loss_settings())
