"""`agrpo_attention.testing`, the offline tiny-model builder: sizes, templates (tools, history rewrite),
loadable checkpoints, its command line and its frozen surface."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agrpo_attention.testing
from agrpo_attention.testing import TinyModelSpec, build_model

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
