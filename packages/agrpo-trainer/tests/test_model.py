"""What `model=` accepts (SPEC F-API): a vision-language checkpoint trains text-only with its towers frozen
and out of the weight stream; a `PreTrainedModel` is used as given; `peft_config` trains the adapter only;
the Gated DeltaNet hybrid trains. Fixed samples, no server (the server paths are in test_lora/test_learning)."""

from __future__ import annotations

import torch
from peft import LoraConfig
from rollout_doubles import fixed_samples
from transformers import AutoModelForCausalLM, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_sync import WeightSync, WeightSyncConfig
from agrpo_trainer import AsyncGRPOConfig
from agrpo_trainer.testing import ReplayTrainer


def _args(tmp_path, **overrides) -> AsyncGRPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, learning_rate=1e-2, max_steps=2,
        per_device_train_batch_size=8, token_budget=0, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=True,
    )  # fmt: skip
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


def _train(model, tmp_path, **kwargs) -> ReplayTrainer:
    tokenizer = build_tokenizer()
    ReplayTrainer.replay_samples = fixed_samples(
        build_model(TinyModelSpec(seed=1), tokenizer), num_prompts=2
    )  # token ids < 512 fit every model here
    trainer = ReplayTrainer(model, None, args=_args(tmp_path), train_dataset=[{"prompt": "x"}] * 2,
                            processing_class=tokenizer, **kwargs)  # fmt: skip
    trainer.train()
    return trainer


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _vision_language_dir(tmp_path) -> str:
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
            rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0]),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "vlm"
    Qwen3VLForConditionalGeneration(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def test_a_vision_language_checkpoint_trains_text_only_with_frozen_towers_left_out_of_sync(tmp_path):
    trainer = ReplayTrainer(
        _vision_language_dir(tmp_path), None, args=_args(tmp_path), train_dataset=[{"prompt": "x"}]
    )
    model = trainer.model
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    before = _snapshot(model)
    ReplayTrainer.replay_samples = fixed_samples(
        build_model(TinyModelSpec(seed=1), build_tokenizer()), num_prompts=2
    )
    trainer.train()
    after = _snapshot(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("visual" not in n for n in changed)
    assert any("language_model" in n for n in changed)
    sync = WeightSync(
        config=WeightSyncConfig(base_url="http://127.0.0.1:9", output_dir=str(tmp_path), backend="disk"),
        backend_name="disk", backend=None, controls=[], rank=0, world_size=1,
    )  # fmt: skip
    sent = [e.meta.name for e in sync.param_stream(model).entries]
    assert sent and not any("visual" in name for name in sent)


def test_a_pretrained_model_is_used_as_given_and_lora_trains_only_the_adapter(tmp_path):
    given = build_model(TinyModelSpec(seed=2), build_tokenizer())
    trainer = _train(given, tmp_path)
    assert trainer.model is given  # switched to tree attention, not reloaded
    base = build_model(TinyModelSpec(seed=2), build_tokenizer())
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    lora = _train(
        base, tmp_path / "lora", peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    after = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): p
        for n, p in lora.model.named_parameters()
    }
    assert all(torch.equal(before[n], after[n]) for n in before), "LoRA must leave the base weights untouched"
    adapters = [p for n, p in lora.model.named_parameters() if "lora_B" in n]
    assert adapters and any(p.abs().sum() > 0 for p in adapters)


def test_the_gated_deltanet_hybrid_trains(tmp_path):
    hybrid = build_model(TinyModelSpec(kind="hybrid", num_layers=4, seed=3), build_tokenizer())
    before = _snapshot(hybrid)
    trainer = _train(hybrid, tmp_path)
    assert isinstance(trainer.model, AutoModelForCausalLM._model_mapping[type(hybrid.config)])
    gate = [n for n in before if "A_log" in n]
    assert gate and any(
        not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in gate
    )
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
