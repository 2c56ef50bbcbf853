"""Rows prepared with pinned, non-blocking copies and a prebuilt plan (`prepare_device_row`, the trainer's
path) train to bit-identical losses and gradients as rows whose plan `token_scores` builds itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_doubles import fixed_samples

from agrpo_attention import enable_tree_attention
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackSample, TreeRow
from agrpo_trainer._device_row import DeviceRow, prepare_device_row
from agrpo_trainer._loss import LossSettings
from agrpo_trainer._step import StepSettings, micro_batch_loss

SETTINGS = StepSettings(
    loss=LossSettings(epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0, score_centering=True),
    temperature=1.0,
    router_aux_loss_coef=0.0,
    truncated_sampling=False,
)


def tiny_model_and_rows():
    """A tiny tree-enabled model and four rows of it, the last without loss terms."""
    model = build_model(TinyModelSpec(seed=3), build_tokenizer())
    samples = [PackSample(**s.pack_fields()) for s in fixed_samples(model, num_prompts=4, seed=1)]
    enable_tree_attention(model, "reference")
    rows = []
    for part in (samples[0::3], samples[1::3], samples[2::3], []):  # the last row has no loss terms
        row = TreeRow(0)
        row.extend(part)
        rows.append(row.pack())
    return model, rows


@pytest.fixture(scope="module")
def model_and_rows():
    return tiny_model_and_rows()


def _assert_same(a, b, where: str) -> None:
    """Equal to the last bit: tensors, dataclasses and tuples field by field."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _train(model, prepared: list[DeviceRow]) -> tuple[list[torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    total = sum(p.row.num_loss_terms for p in prepared)
    losses = []
    for p in prepared:
        loss, _ = micro_batch_loss(model, p.row, SETTINGS, step_trained_tokens=total, world_size=1,
                                   micro_batches_per_step=len(prepared), plan=p.plan)  # fmt: skip
        loss.backward()
        losses.append(loss.detach())
    return losses, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_prepared_rows_train_bit_identically_to_rows_planned_inside_token_scores(model_and_rows):
    model, rows = model_and_rows
    prepared = [prepare_device_row(row, model) for row in rows]
    _assert_same(prepared, [prepare_device_row(row, model) for row in rows], "rows")  # deterministic
    assert prepared[-1].plan is None and prepared[0].plan is not None  # no plan for a row without loss terms
    losses, grad = _train(model, prepared)
    plain_losses, plain_grad = _train(model, [DeviceRow(row=row, plan=None) for row in rows])
    assert grad.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    assert torch.equal(grad, plain_grad)
