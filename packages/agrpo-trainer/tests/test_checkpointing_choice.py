"""`checkpointing_mode="auto"`: from the first step's memory the least recompute that fits is chosen, rows
larger than the first step's are accounted for, and where the allocator has no statistics (CPU) it stays
`full`, saying so."""

from __future__ import annotations

import logging

from agrpo_trainer._checkpointing_choice import (
    HEADROOM,
    LayerProbe,
    MemoryObservation,
    choose_layer_modes,
    describe,
    predicted_peaks,
)
from agrpo_trainer._layer_region import LayerRegions, RegionSettings

GIB = 2**30


def _observation(capacity_gib: float, *, row_tokens: int = 16384) -> MemoryObservation:
    """A 1.7B-like first step: 20 GiB weights + optimizer, full checkpointing peaking at 34 GiB, and what
    each mode keeps per token of one layer (none ~100 KB, selective ~24 KB, full ~8 KB)."""
    return MemoryObservation(
        start=7 * GIB, fwd_bwd_peak=34 * GIB, after=20 * GIB, capacity=int(capacity_gib * GIB),
        row_tokens=row_tokens, max_row_tokens=16384, num_layers=28,
        kept_per_token={"none": 100e3, "selective": 24e3, "full": 8e3},
    )  # fmt: skip


def test_the_least_recompute_that_fits_is_chosen():
    peaks = predicted_peaks(_observation(140))
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert peaks["full"] == 20 * GIB + 27 * GIB  # the optimizer states, then the first step's growth
    assert choose_layer_modes(_observation(140)) == ("none",) * 28
    assert (
        choose_layer_modes(_observation((peaks["selective"] + 1e4) / HEADROOM / GIB)) == ("selective",) * 28
    )
    assert choose_layer_modes(_observation((peaks["full"] + 1e4) / HEADROOM / GIB)) == ("full",) * 28
    assert (
        choose_layer_modes(_observation(peaks["full"] / HEADROOM / GIB - 1)) == ("full",) * 28
    )  # nothing fits


def test_where_a_whole_mode_does_not_fit_as_many_layers_as_fit_recompute_less():
    peaks = predicted_peaks(_observation(140))
    per_layer = (peaks["selective"] - peaks["full"]) / 28  # 16 KB x 16384 tokens = 256 MiB a layer
    for fit in (1, 10, 27):
        modes = choose_layer_modes(_observation((peaks["full"] + fit * per_layer + 1) / HEADROOM / GIB))
        assert modes == ("selective",) * fit + ("full",) * (28 - fit), fit
    per_none = (peaks["none"] - peaks["selective"]) / 28
    modes = choose_layer_modes(_observation((peaks["selective"] + 5 * per_none + 1) / HEADROOM / GIB))
    assert modes == ("none",) * 5 + ("selective",) * 23
    assert (
        describe(modes) == "none for 5 of 28 layers, selective for 23" and describe(("full",) * 3) == "full"
    )


def test_mixed_modes_reach_each_layer():
    regions = LayerRegions(RegionSettings(compile=False, checkpointing="auto"))
    regions.set_layer_modes(("selective", "selective", "full"))
    assert [regions.mode_of(i) for i in range(3)] == [
        "selective",
        "selective",
        "full",
    ] and regions.mode == "full"
    regions.set_layer_modes(("none",) * 3)
    assert regions.layer_modes is None and regions.mode == "none"


def test_a_first_step_of_short_rows_is_scaled_to_the_row_budget():
    short, full_rows = predicted_peaks(_observation(140, row_tokens=4096)), predicted_peaks(_observation(140))
    assert short["full"] > full_rows["full"]  # the growth is scaled up 4x (gradients too: on the safe side)


def test_the_probe_runs_each_mode_on_one_layer_of_the_first_micro_batch():
    probe = LayerProbe(active=True)
    assert [probe.mode_for(i) for i in range(4)] == ["none", "selective", "full", None]
    probe.kept_per_token["none"] = 1.0
    assert probe.mode_for(0) is None  # measured once
    assert LayerProbe().mode_for(0) is None  # inactive after the first step


def test_auto_stays_full_without_allocator_statistics(caplog):
    import torch

    regions = LayerRegions(RegionSettings(compile=False, checkpointing="auto"))
    regions.device = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="agrpo_trainer"):
        regions.choice.on_step_begin(None, None, None)
        regions.choice.on_step_end(None, None, None)
    assert regions.mode == "full" and "checkpointing stays full" in caplog.text
