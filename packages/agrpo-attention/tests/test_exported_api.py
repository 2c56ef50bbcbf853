"""Freezes agrpo_attention's public surface (style.md habit 14): growing it is a reviewed decision."""

import agrpo_attention

EXPECTED = [
    "BackendUnavailableError",
    "RoutingReplaySettings",
    "TokenScores",
    "TreeAttentionError",
    "TreePlan",
    "TreePlanMissingError",
    "UnsupportedModelError",
    "available_backends",
    "build_tree_plan",
    "deltanet_traceable",
    "enable_routing_replay",
    "enable_tree_attention",
    "gathered_logprobs",
    "token_logprobs",
    "token_scores",
]


def test_all_is_frozen_and_sorted():
    assert agrpo_attention.__all__ == EXPECTED


def test_every_exported_name_resolves():
    for name in EXPECTED:
        assert getattr(agrpo_attention, name) is not None
