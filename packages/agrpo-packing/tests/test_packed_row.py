"""`PackedRow`: derived properties and `to`."""

from __future__ import annotations

import numpy as np
import torch

from agrpo_packing import PackSample, TreeRow


def _row(share: bool, routes: bool = False):
    row = TreeRow(0, share_prefixes=share)
    for ids in ([1, 2, 3, 4], [1, 2, 3, 5]):
        row.add(
            PackSample(
                input_ids=np.array(ids),
                trained_mask=np.array([False, False, True, True]),
                group_id=0,
                advantages=np.ones(2),
                sampler_logprobs=np.zeros(2),
                routed_experts=np.array(ids)[:, None, None].repeat(2, 1).repeat(3, 2) if routes else None,
            )
        )
    return row.pack()


def test_sizes_and_packing_ratio():
    packed = _row(share=True)
    assert (packed.num_tokens, packed.num_segments, packed.num_loss_terms) == (4, 3, 4)
    assert packed.packing_ratio == 8 / 4 and not packed.is_plain


def test_plain_rows_need_no_gather():
    packed = _row(share=False)
    assert packed.is_plain and torch.equal(packed.kv_index, torch.arange(packed.num_tokens))


def test_to_moves_every_tensor_and_keeps_counts():
    packed = _row(share=True).to("cpu")
    assert packed.advantages.dtype == torch.float32 and packed.kv_index.dtype == torch.int64
    assert packed.num_samples == 2 and packed.num_raw_tokens == 8


def test_to_moves_routes_with_the_other_tensors():
    packed = _row(share=True, routes=True)
    moved = packed.to("meta")
    assert moved.routed_experts.device.type == "meta" and moved.routed_experts.shape == (4, 2, 3)
    assert moved.routed_experts.dtype == torch.int16 and moved.route_conflicts == packed.route_conflicts == 0
    assert _row(share=True).routed_experts is None
