"""`Manifest`: the pre-flight comparison names every missing, extra, misshapen or re-typed tensor."""

from __future__ import annotations

import torch

from agrpo_sync import TensorMeta
from agrpo_sync._manifest import Manifest

SERVED = [TensorMeta("a.weight", torch.float32, (4, 2)), TensorMeta("b.weight", torch.float32, (3,))]


def test_the_same_tensors_pass_and_each_kind_of_difference_is_named():
    reference = Manifest.of(SERVED, "the first sync (version 1)")
    assert reference.problems(Manifest.of(SERVED, "this sync")) == []
    sent = [
        TensorMeta("a.weight", torch.float32, (4, 3)),
        TensorMeta("c.weight", torch.float32, (1,)),
    ]
    assert reference.problems(Manifest.of(sent, "this sync")) == [
        "1 missing: b.weight",
        "1 not in the first sync (version 1): c.weight",
        "1 with another shape: a.weight [4, 3] (expected [4, 2])",
    ]
    retyped = [TensorMeta("a.weight", torch.bfloat16, (4, 2)), SERVED[1]]
    assert reference.problems(Manifest.of(retyped, "this sync")) == [
        "1 with another dtype: a.weight bfloat16 (expected float32)"
    ]


def test_long_lists_are_cut_and_counted():
    reference = Manifest.of([TensorMeta(f"t{i:02d}", torch.float32, (1,)) for i in range(20)], "x")
    (problem,) = reference.problems(Manifest.of([], "this sync"))
    assert problem.startswith("20 missing: t00, t01,") and problem.endswith("and 12 more")


def test_weight_info_gives_a_manifest_only_when_it_lists_tensors():
    assert Manifest.from_weight_info({"weight_version": "default"}) is None  # vLLM 0.32 / 0.33
    listed = {"parameters": {"a.weight": {"shape": [4, 2], "dtype": "torch.float32"}}}
    manifest = Manifest.from_weight_info(listed)
    assert manifest.tensors == {"a.weight": ("float32", (4, 2))}
    assert manifest.source == "the server's /weight_info"
