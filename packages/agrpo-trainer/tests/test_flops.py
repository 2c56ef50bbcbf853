"""Model FLOPs of packed rows and the device peak table (`_flops`), and the MFU the step clock derives from them."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackSample, TreeRow
from agrpo_trainer._flops import ModelFlops, peak_flops, precision_of
from agrpo_trainer._step_metrics import StepClock


def _sample(ids: list[int], trained_from: int, group_id: int = 0) -> PackSample:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.arange(len(ids)) >= trained_from
    n = int(mask.sum())
    return PackSample(input_ids=ids, trained_mask=mask, group_id=group_id,
                      advantages=np.ones(n, np.float32), sampler_logprobs=np.zeros(n, np.float32))  # fmt: skip


def _row(*samples: PackSample):
    row = TreeRow(0)
    for sample in samples:
        row.add(sample)
    return row.pack()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_body_excludes_embeddings_and_the_head_whether_tied_or_not(tokenizer):
    untied = build_model(TinyModelSpec(tie_word_embeddings=False), tokenizer)
    tied = build_model(TinyModelSpec(), tokenizer)
    table = 512 * 64  # vocab x hidden
    assert ModelFlops.of(untied).body_params == sum(p.numel() for p in untied.parameters()) - 2 * table
    assert ModelFlops.of(tied).body_params == sum(p.numel() for p in tied.parameters()) - table
    flops = ModelFlops.of(untied)
    assert (flops.head_params, flops.attention_windows, flops.attention_width) == (table, (None, None), 2 * 32)


def test_a_hybrid_counts_only_its_softmax_attention_layers(tokenizer):
    hybrid = build_model(TinyModelSpec(kind="hybrid", num_layers=4), tokenizer)
    assert ModelFlops.of(hybrid).attention_windows == (None,)


@pytest.mark.parametrize(
    ("kind", "windows"),
    [("gemma3", (4, 4, None, 4)), ("gpt_oss", (4, None, 4, None)), ("mistral", (4, 4, 4, 4)), ("qwen3", (None,) * 4)],
)
def test_a_windowed_layer_counts_only_the_pairs_its_window_attends(tokenizer, kind, windows):
    flops = ModelFlops.of(build_model(TinyModelSpec(kind=kind, num_layers=4, sliding_window=4), tokenizer))
    assert flops.attention_windows == windows
    a = _sample(list(range(5, 15)), trained_from=5)
    b = _sample([*range(5, 10), 30, 31, 32], trained_from=5)
    shared = _row(a, b)
    depth = shared.position_ids.to(torch.int64)
    full, windowed = int((depth + 1).sum()), int((depth + 1).clamp(max=4).sum())
    assert windowed < full
    layers = [windowed if w else full for w in windows]
    without_attention = ModelFlops(flops.body_params, flops.head_params, (), flops.attention_width)
    attention = flops.row_flops(shared) - without_attention.row_flops(shared)
    assert attention == pytest.approx(12 * flops.attention_width * sum(layers))


def test_a_shared_prefix_is_counted_once_in_tokens_and_attended_pairs(tokenizer):
    flops = ModelFlops.of(build_model(TinyModelSpec(tie_word_embeddings=False), tokenizer))
    a = _sample([5, 6, 7, 8, 9, 10, 11, 12], trained_from=5)
    b = _sample([5, 6, 7, 8, 9, 20, 21, 22, 23], trained_from=5)
    alone_a, alone_b, shared = _row(a), _row(b), _row(a, b)
    k = alone_a.num_tokens + alone_b.num_tokens - shared.num_tokens
    assert k >= 4, "the five prompt tokens are shared (forks happen one token early)"

    def causal_pairs(n: int) -> int:  # a plain causal sequence: token i attends to i + 1 keys
        return n * (n + 1) // 2

    attended = causal_pairs(alone_a.num_tokens) + causal_pairs(alone_b.num_tokens) - causal_pairs(k)
    expected = (6 * flops.body_params * shared.num_tokens + 6 * flops.head_params * shared.num_loss_terms
                + 12 * 2 * 64 * attended)  # fmt: skip
    assert flops.row_flops(shared) == pytest.approx(expected)
    assert flops.row_flops(shared) < flops.row_flops(alone_a) + flops.row_flops(alone_b)


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "tf32", 495e12),
     ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12), ("AMD Instinct MI300X", "bf16", 1307e12),
     ("AMD Instinct MI300X", "fp32", None), ("NVIDIA GeForce GT 710", "bf16", None)],
)  # fmt: skip
def test_the_peak_is_looked_up_by_device_name_and_precision(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), precision) == peak


def test_a_cpu_has_no_peak_and_the_precision_follows_autocast_then_the_weights(tokenizer):
    assert peak_flops(torch.device("cpu"), "bf16") is None
    model = build_model(TinyModelSpec(), tokenizer)
    assert precision_of(model, mixed_precision=True) == "bf16"
    assert precision_of(model, mixed_precision=False) == "fp32"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert precision_of(model, mixed_precision=False) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert precision_of(model.to(torch.bfloat16), mixed_precision=False) == "bf16"


def test_the_clock_reports_mfu_on_both_time_bases_only_with_a_peak(tokenizer):
    flops = ModelFlops.of(build_model(TinyModelSpec(), tokenizer))
    row = _row(_sample(list(range(3, 40)), trained_from=10))
    clock = StepClock()
    clock.flop_model = flops
    for peak in (None, 1e9):
        clock.peak_flops = peak
        clock.step_started()
        with clock.fwd_bwd():
            with clock.forward():
                time.sleep(0.01)
            time.sleep(0.02)
        clock.add_tokens(row)
        time.sleep(0.01)
        out = clock.take()
        assert 0.01 <= out["perf/fwd_s"] < out["perf/fwd_bwd_s"] < out["perf/step_s"]
        if peak is None:
            assert not any(k.startswith("perf/mfu") for k in out)
            continue
        assert out["perf/mfu_fwd_bwd"] == pytest.approx(flops.row_flops(row) / (out["perf/fwd_bwd_s"] * peak))
        assert out["perf/mfu_wall_clock"] == pytest.approx(flops.row_flops(row) / (out["perf/step_s"] * peak))


def test_a_mixture_of_experts_counts_the_share_of_expert_weights_a_token_uses(tokenizer):
    moe = build_model(TinyModelSpec(kind="moe"), tokenizer)  # 4 experts, 2 per token
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in moe.parameters()) - 512 * 64 - experts  # tied head: one table
    assert ModelFlops.of(moe).body_params == dense + experts // 2
