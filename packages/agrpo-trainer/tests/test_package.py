"""Smoke test of agrpo-trainer's wiring: it sees the four libraries through their public roots."""

from __future__ import annotations

import importlib

import agrpo_trainer


def test_trainer_reaches_every_library_through_its_root():
    for name in ["agrpo_rollout", "agrpo_packing", "agrpo_attention", "agrpo_sync"]:
        library = importlib.import_module(name)
        assert library.__all__, f"{name} exports nothing"
        for symbol in library.__all__:
            assert getattr(library, symbol) is not None
    assert agrpo_trainer.__version__
