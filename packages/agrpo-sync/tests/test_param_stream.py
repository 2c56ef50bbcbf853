"""`ParamStream`: which tensors are sent, under which names, and how much is gathered at once."""

from __future__ import annotations

import torch
from torch import nn

from agrpo_sync import ParamStream
from agrpo_sync._param_stream import WireEntry, clean_name, plain_entries, plan_buckets
from agrpo_sync._wire_format import TensorMeta


class _TinyVLM(nn.Module):
    """A vision-language shape: a vision tower, a projector and a text model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.visual = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.model.multi_modal_projector = nn.Linear(4, 8)
        self.model.language_model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.lm_head = nn.Linear(8, 16, bias=False)


NON_TEXT = ("visual", "multi_modal_projector")


def test_frozen_non_text_towers_are_skipped_and_trainable_ones_sent():
    model = _TinyVLM()
    model.model.visual.requires_grad_(False)
    names = [e.meta.name for e in plain_entries(model, None, NON_TEXT)]
    assert not any("visual" in n for n in names)
    assert "model.multi_modal_projector.weight" in names and "lm_head.weight" in names
    model.model.visual[1].weight.requires_grad_(True)  # partly trained: the whole tower goes
    assert sum("visual" in e.meta.name for e in plain_entries(model, None, NON_TEXT)) == 4


def test_frozen_text_parameters_are_still_sent():
    model = _TinyVLM()
    model.model.language_model.requires_grad_(False)
    assert sum("language_model" in e.meta.name for e in plain_entries(model, None, NON_TEXT)) == 4


def test_wrapper_segments_are_removed_from_names():
    assert clean_name("model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )


def test_buckets_are_bounded_and_a_large_tensor_is_a_bucket_of_its_own():
    entries = [
        WireEntry(meta=TensorMeta(f"t{i}", torch.float32, (n,)), sources=(torch.zeros(n),))
        for i, n in enumerate([10, 10, 10, 100, 5])
    ]
    buckets = plan_buckets(entries, bucket_bytes=80)
    assert [[e.meta.name for e in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]


def test_the_stream_casts_gathers_once_and_drains_only_what_is_left():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    stream = ParamStream(plain_entries(model, torch.bfloat16, ()), bucket_bytes=1200)
    assert all(m.dtype == torch.bfloat16 for m in stream.metadata())
    buckets = stream.buckets()
    first = next(buckets)
    assert [n for n, _ in first] == ["0.weight", "0.bias"] and first[0][1].dtype == torch.bfloat16
    assert torch.equal(first[0][1], model[0].weight.detach().bfloat16())
    stream.drain()
    assert list(stream.buckets()) == [] and stream.peak_bucket_bytes <= 1200
    assert stream.nbytes == sum(p.numel() * 2 for p in model.parameters())
