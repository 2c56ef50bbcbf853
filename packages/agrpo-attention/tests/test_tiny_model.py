"""`agrpo_attention.testing`, the offline tiny-model builder: sizes, templates (tools, history rewrite),
loadable checkpoints, its command line and its frozen surface."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agrpo_attention.testing
from agrpo_attention.testing import TinyModelSpec, build_model, save_tiny_model

EXPORTED = [
    "HISTORY_REWRITE_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "TOOL_TEMPLATE",
    "TinyModelSpec",
    "build_model",
    "build_tokenizer",
    "let_triton_run_on_cpu",
    "save_tiny_model",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": "<think>I should add.</think>Let me add.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    },
    {"role": "tool", "content": "5"},
]


def test_tokenizer_size_equals_model_vocab(tool_tokenizer):
    assert len(tool_tokenizer) == TinyModelSpec().vocab_size
    assert tool_tokenizer.decode(tool_tokenizer.encode("What is 12 + 30?")) == "What is 12 + 30?"


def test_tool_template_renders_tools_and_calls_in_order(tool_tokenizer):
    text = tool_tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "add"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_history_rewrite_template_breaks_the_token_prefix(tool_tokenizer, rewrite_tokenizer):
    """The next turn's prompt no longer extends the tokens of the turn the model sampled: a fork."""
    sampled = rewrite_tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=True)["input_ids"]
    next_prompt = rewrite_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True
    )
    assert next_prompt["input_ids"][: len(sampled)] != sampled
    kept = tool_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    assert (
        kept["input_ids"][: len(sampled)] == tool_tokenizer.apply_chat_template(CONVERSATION[:3])["input_ids"]
    )
    assert "<think>" not in rewrite_tokenizer.decode(next_prompt["input_ids"])


def test_hybrid_interleaves_gated_deltanet_and_attention(tool_tokenizer):
    model = build_model(TinyModelSpec(kind="hybrid", num_layers=4), tool_tokenizer)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert type(model.model.layers[0].linear_attn).__name__ == "Qwen3_5GatedDeltaNet"


def test_qwen3_next_has_the_fused_layout_gated_attention_and_shared_experts(tool_tokenizer):
    model = build_model(TinyModelSpec(kind="qwen3_next", num_layers=4), tool_tokenizer)
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    deltanet, attention = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    assert hasattr(deltanet, "in_proj_qkvz") and hasattr(deltanet, "in_proj_ba")
    assert (
        deltanet.head_k_dim == deltanet.head_v_dim == 128 and deltanet.num_v_heads == 2 * deltanet.num_k_heads
    )
    assert (
        attention.q_proj.out_features == 2 * model.config.num_attention_heads * model.config.head_dim
    )  # + gate
    assert all(hasattr(layer.mlp, "shared_expert") for layer in model.model.layers)
    assert model.model.layers[0].mlp.experts.num_experts == 4 and model.config.num_experts_per_tok == 2


def test_saved_models_load_offline_and_are_deterministic(tiny_qwen3_dir, tiny_hybrid_dir, tool_tokenizer):
    ids = torch.tensor([tool_tokenizer.encode("What is 2 + 3?")])
    for directory, kind in [(tiny_qwen3_dir, "qwen3"), (tiny_hybrid_dir, "hybrid")]:
        loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
        rebuilt = build_model(
            TinyModelSpec(kind=kind, num_layers=loaded.config.num_hidden_layers), tool_tokenizer
        )
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, rebuilt(ids).logits)
        assert len(AutoTokenizer.from_pretrained(directory)) == loaded.config.vocab_size


def test_testing_exports_are_frozen():
    assert agrpo_attention.testing.__all__ == EXPORTED


def test_command_line_writes_a_servable_model(tmp_path, capsys):
    agrpo_attention.testing.main([str(tmp_path / "m"), "--kind", "hybrid", "--num-layers", "4", "--untied"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["tie_word_embeddings"] is False
    assert (tmp_path / "m" / "model.safetensors").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()


WINDOWED = ["gpt_oss", "gemma2", "gemma3", "gemma3_vlm", "mistral"]
SLIDING, FULL = "sliding_attention", "full_attention"


def _eager(model):
    model.set_attn_implementation("eager")
    return model


def _windowed(kind: str, tokenizer, **spec):
    return _eager(build_model(TinyModelSpec(kind=kind, num_layers=4, **spec), tokenizer))


@pytest.mark.parametrize(
    ("kind", "model_class", "layer_types"),
    [
        ("gpt_oss", "GptOssForCausalLM", [SLIDING, FULL, SLIDING, FULL]),
        ("gemma2", "Gemma2ForCausalLM", [SLIDING, FULL, SLIDING, FULL]),
        ("gemma3", "Gemma3ForCausalLM", [SLIDING, SLIDING, FULL, SLIDING]),
        ("gemma3_vlm", "Gemma3ForConditionalGeneration", [SLIDING, SLIDING, FULL, SLIDING]),
        ("mistral", "MistralForCausalLM", None),
    ],
)
def test_windowed_kinds_have_their_layer_types_and_window(tool_tokenizer, kind, model_class, layer_types):
    model = _windowed(kind, tool_tokenizer, sliding_window=12)
    text = model.config.get_text_config()
    assert type(model).__name__ == model_class
    assert getattr(text, "layer_types", None) == layer_types and text.sliding_window == 12
    assert text.vocab_size == len(tool_tokenizer) and text.head_dim == 32


def test_small_windowed_models_keep_a_global_layer(tool_tokenizer):
    for kind in ["gpt_oss", "gemma2", "gemma3"]:
        model = build_model(TinyModelSpec(kind=kind, num_layers=2), tool_tokenizer)
        assert model.config.layer_types == [SLIDING, FULL]


def test_gpt_oss_sinks_are_wide_random_parameters_that_move_the_output(tool_tokenizer):
    model = _windowed("gpt_oss", tool_tokenizer)
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    assert all(isinstance(s, torch.nn.Parameter) and s.shape == (2,) for s in sinks)
    assert 0.3 < torch.cat(sinks).abs().mean() < 3  # N(0, 1), not transformers' N(0, 0.02)
    assert model.model.layers[0].mlp.experts.num_experts == 4 and model.config.num_experts_per_tok == 2
    ids = torch.tensor([tool_tokenizer.encode("What is 12 + 30? " * 3)])
    with torch.no_grad():
        with_sinks = model(ids).logits.log_softmax(-1)
        for s in sinks:
            s.fill_(-1e4)
        without = model(ids).logits.log_softmax(-1)
    assert (with_sinks - without).abs().max() > 0.05


def test_gemma2_softcaps_and_query_scale_bite(tool_tokenizer):
    model = _windowed("gemma2", tool_tokenizer)
    config = model.config
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (10.0, 30.0)
    assert config.query_pre_attn_scalar == 2 * config.head_dim
    ids = torch.tensor([tool_tokenizer.encode("What is 12 + 30? " * 3)])
    with torch.no_grad():
        capped = model(ids).logits.log_softmax(-1)
        for name in ["attn_logit_softcapping", "final_logit_softcapping"]:
            kept = getattr(config, name)
            setattr(config, name, None)
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = config.attn_logit_softcapping
            assert (model(ids).logits.log_softmax(-1) - capped).abs().max() > 0.05, name
            setattr(config, name, kept)
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = config.attn_logit_softcapping


def test_gemma3_has_a_rope_base_per_layer_type(tool_tokenizer):
    for kind in ["gemma3", "gemma3_vlm"]:
        text = build_model(TinyModelSpec(kind=kind), tool_tokenizer).config.get_text_config()
        thetas = {t: text.rope_parameters[t]["rope_theta"] for t in [SLIDING, FULL]}
        assert thetas == {SLIDING: 10_000.0, FULL: 1_000_000.0}
        assert text.query_pre_attn_scalar == text.head_dim and text.final_logit_softcapping is None


def test_gemma3_vlm_is_the_text_tower_under_a_tiny_vision_tower(tool_tokenizer):
    model = _windowed("gemma3_vlm", tool_tokenizer, tie_word_embeddings=False)
    assert type(model.model.vision_tower).__name__ == "SiglipVisionModel"
    assert type(model.model.language_model).__name__ == "Gemma3TextModel"
    assert model.config.image_token_id >= len(tool_tokenizer)  # no image token in the tiny vocabulary
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([tool_tokenizer.encode("What is 2 + 3?")])
    pixels = torch.randn(1, 3, 32, 32)
    image = model.model.get_image_features(pixels, return_dict=True).pooler_output
    assert image.shape == (1, 4, model.config.text_config.hidden_size)
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tool_tokenizer))


@pytest.mark.parametrize("kind", WINDOWED)
def test_the_window_changes_the_stock_output_past_it_only(tool_tokenizer, kind):
    """Same weights (same seed) with a window of 8 and with one longer than the sequence: the logits agree on the
    first 8 positions and differ after."""
    narrow = _windowed(kind, tool_tokenizer, sliding_window=8)
    wide = _windowed(kind, tool_tokenizer, sliding_window=4096)
    ids = torch.tensor([tool_tokenizer.encode("What is 12 + 30? Let me add. " * 2)[:24]])
    with torch.no_grad():
        a, b = narrow(ids).logits.log_softmax(-1), wide(ids).logits.log_softmax(-1)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert (a[:, 8:] - b[:, 8:]).abs().amax(-1).min() > 1e-4  # every position past the window
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 0.01


@pytest.mark.parametrize("kind", WINDOWED)
@pytest.mark.parametrize("tied", [True, False])
def test_windowed_kinds_save_and_reload(tmp_path, tool_tokenizer, kind, tied):
    spec = TinyModelSpec(kind=kind, tie_word_embeddings=tied)
    directory = save_tiny_model(tmp_path / kind, spec)
    loaded = _eager(AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)).eval()
    rebuilt = _eager(build_model(spec, tool_tokenizer))
    assert type(loaded) is type(rebuilt)
    assert loaded.config.get_text_config().sliding_window == spec.sliding_window
    head, embed = loaded.get_output_embeddings().weight, loaded.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) is tied
    ids = torch.tensor([tool_tokenizer.encode("What is 12 + 30? " * 2)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, rebuilt(ids).logits)
