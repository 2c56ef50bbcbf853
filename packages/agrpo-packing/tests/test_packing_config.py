"""`PackingConfig`: validation and the budget in force."""

from __future__ import annotations

import pytest

from agrpo_packing import PackingConfig


def test_none_budget_means_the_servers_max_model_len():
    config = PackingConfig(token_budget=None, max_model_len=4096)
    assert config.resolved_budget == 4096 and not config.fixed_count


def test_none_budget_without_max_model_len_names_the_fix():
    with pytest.raises(ValueError, match="pass max_model_len"):
        PackingConfig(token_budget=None)


def test_non_positive_budget_is_fixed_count_mode():
    config = PackingConfig(token_budget=0, num_ranks=4, per_device_train_batch_size=2)
    assert config.fixed_count and config.samples_per_micro_batch == 8


@pytest.mark.parametrize("field", ["num_ranks", "per_device_train_batch_size"])
def test_counts_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        PackingConfig(token_budget=8, **{field: 0})


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        PackingConfig(8)
