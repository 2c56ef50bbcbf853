"""PEFT LoRA models: merged weights equal PEFT's own merge; adapter tensors carry PEFT's saved names."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from agrpo_sync import ParamStream, SyncSetupError
from agrpo_sync._lora_weights import adapter_entries, has_lora, merged_entries


def _peft(tiny_model, perturb, **lora):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **lora)
    model = get_peft_model(tiny_model(), config)
    perturb(model, 7, skip="", only="lora_", scale=0.2)
    return model


def test_merged_weights_equal_peft_merge_and_unload(tiny_model, perturb):
    model = _peft(tiny_model, perturb)
    assert has_lora(model) and not has_lora(tiny_model())
    merged = dict(ParamStream(merged_entries(model, None, ()), bucket_bytes=4096))
    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor.detach(), rtol=1e-5, atol=1e-6)


def test_modules_to_save_replace_their_original_in_merged_weights(tiny_model, perturb):
    model = _peft(tiny_model, perturb, modules_to_save=["model.norm"])
    with torch.no_grad():
        model.base_model.model.model.norm.modules_to_save["default"].weight.fill_(3.0)
    merged = dict(ParamStream(merged_entries(model, None, ()), bucket_bytes=1 << 20))
    assert torch.all(merged["model.norm.weight"] == 3.0)


def test_adapter_tensors_have_the_names_peft_saves(tiny_model, perturb):
    model = _peft(tiny_model, perturb)
    ours = dict(ParamStream(adapter_entries(model, None), bucket_bytes=1 << 20))
    saved = get_peft_model_state_dict(model)
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[k], saved[k]) for k in saved)


def test_dora_is_refused_with_the_setting_to_change(tiny_model, perturb):
    model = _peft(tiny_model, perturb, use_dora=True)
    with pytest.raises(SyncSetupError, match="use_dora=False"):
        merged_entries(model, None, ())
    with pytest.raises(SyncSetupError, match="use_dora=False"):
        adapter_entries(model, None)
