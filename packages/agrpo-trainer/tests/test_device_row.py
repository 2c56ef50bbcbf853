"""Rows prepared ahead on the worker thread (`RowPrefetcher`) are exactly the rows prepared in the trainer's
thread, train to bit-identical losses and gradients, and an error on the worker reaches the trainer."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from rollout_doubles import fixed_samples

from agrpo_attention import enable_tree_attention
from agrpo_packing import PackSample, TreeRow
from agrpo_trainer._device_row import DeviceRow, RowPrefetcher, prepare_device_row
from agrpo_trainer._loss import LossSettings
from agrpo_trainer._step import StepSettings, micro_batch_loss
from tools.tiny_models import TinyModelSpec, build_model, build_tokenizer

SETTINGS = StepSettings(
    loss=LossSettings(epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0, score_centering=True),
    temperature=1.0,
    router_aux_loss_coef=0.0,
    truncated_sampling=False,
)


@pytest.fixture(scope="module")
def model_and_rows():
    model = build_model(TinyModelSpec(seed=3), build_tokenizer())
    samples = [PackSample(**s.pack_fields()) for s in fixed_samples(model, num_prompts=4, seed=1)]
    enable_tree_attention(model, "reference")
    rows = []
    for part in (samples[0::3], samples[1::3], samples[2::3], []):  # the last row has no loss terms
        row = TreeRow(0)
        row.extend(part)
        rows.append(row.pack())
    return model, rows


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


def test_prefetched_rows_equal_sequential_ones_and_train_bit_identically(model_and_rows):
    model, rows = model_and_rows
    sequential = [prepare_device_row(row, model) for row in rows]
    prefetcher = RowPrefetcher(lambda row: prepare_device_row(row, model), "cpu", lookahead=1)
    try:
        for _ in range(2):  # two steps through one prefetcher
            prefetcher.begin(rows)
            prefetched = [prefetcher.take(i) for i in range(len(rows))]
            _assert_same(prefetched, sequential, "rows")
    finally:
        prefetcher.close()
    assert sequential[-1].plan is None and sequential[0].plan is not None
    seq_losses, seq_grad = _train(model, sequential)
    pre_losses, pre_grad = _train(model, prefetched)
    plain_losses, plain_grad = _train(
        model, [DeviceRow(row=row, plan=None) for row in rows]
    )  # plan built inside
    assert seq_grad.abs().max() > 0
    for other_losses, other_grad in ((pre_losses, pre_grad), (plain_losses, plain_grad)):
        assert all(torch.equal(a, b) for a, b in zip(seq_losses, other_losses, strict=True))
        assert torch.equal(seq_grad, other_grad)


def test_prefetcher_works_ahead_on_its_own_thread_and_never_past_the_lookahead(model_and_rows):
    _, rows = model_and_rows
    started: list[int] = []
    threads: set[str] = set()
    release = threading.Event()

    def prepare(row):
        started.append(next(i for i, r in enumerate(rows) if r is row))
        threads.add(threading.current_thread().name)
        release.wait(5.0)
        return DeviceRow(row=row, plan=None)

    prefetcher = RowPrefetcher(prepare, "cpu", lookahead=1)
    try:
        prefetcher.begin(rows)
        release.set()
        assert prefetcher.take(0).row is rows[0]
        prefetcher._futures[1].result(5.0)
        assert started == [0, 1]  # row 1 prepared while row 0 is in use, row 2 not yet
        assert all(prefetcher.take(i).row is rows[i] for i in range(1, len(rows)))
    finally:
        prefetcher.close()
    assert (
        threads == {t for t in threads if t.startswith("agrpo-rows")}
        and threading.current_thread().name not in threads
    )


def test_an_error_on_the_worker_is_raised_by_take_of_that_row(model_and_rows):
    _, rows = model_and_rows

    def prepare(row):
        if row is rows[1]:
            raise ValueError("bad row 1")
        return DeviceRow(row=row, plan=None)

    prefetcher = RowPrefetcher(prepare, "cpu")
    try:
        prefetcher.begin(rows)
        assert prefetcher.take(0).row is rows[0]
        with pytest.raises(ValueError, match="bad row 1"):
            prefetcher.take(1)
        with pytest.raises(IndexError, match="call begin"):
            prefetcher.take(len(rows))
    finally:
        prefetcher.close()
