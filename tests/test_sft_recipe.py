"""The SFT recipe of agrpo-packing's README, made real: `examples/sft_packed_chat.py` fine-tunes a tiny model
with `transformers.Trainer`, `SFTCollator` as the data collator and tree attention, on multi-turn chats
that share a system prompt, and the packed run's loss equals the stock padded run's, step for step,
while it forwards about half the tokens.

Cross-package (packing + attention + transformers), hence here rather than in a package's tests.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft_packed_chat.py"
LOSS_RTOL = 1e-5
"""fp32; measured: 9e-8 (Qwen3, 6 steps) and 1.7e-7 (Gated DeltaNet hybrid, 4 steps) relative."""


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("sft_packed_chat", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize(("kind", "steps"), [("qwen3", 4), ("hybrid", 2)])
def test_packed_sft_loss_equals_the_padded_runs_with_fewer_tokens_forwarded(example, kind, steps, capsys):
    packed, padded, raw_tokens = example.main(["--kind", kind, "--steps", str(steps), "--batch-size", "8"])
    assert len(packed.losses) == len(padded.losses) == steps
    for step, (a, b) in enumerate(zip(packed.losses, padded.losses, strict=True), 1):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"step {step}: packed {a} vs padded {b}"
    assert packed.losses[-1] < packed.losses[0], "it trains"
    # the ~60-token system prompt is forwarded once per batch of 8 instead of 8 times
    assert raw_tokens / packed.forwarded_tokens > 1.8, (raw_tokens, packed.forwarded_tokens)
    assert padded.forwarded_tokens >= raw_tokens
    printed = capsys.readouterr().out
    ratio = float(re.search(r"([0-9.]+)x fewer than the examples' tokens", printed).group(1))
    assert ratio == pytest.approx(raw_tokens / packed.forwarded_tokens, abs=0.01)


@pytest.mark.parametrize(
    ("readme", "heading"),
    [("packages/agrpo-packing/README.md", "## SFT recipe"), ("README.md", r"\*\*2\. Prefix-shared packing")],
)
def test_readme_recipe_is_the_examples_code(readme, heading):
    """The READMEs show the recipe's core: its imports import, and every other line is in the example this
    file runs (so the READMEs cannot drift from what is tested)."""
    text = (ROOT / readme).read_text()
    block = re.search(heading + r".*?```python\n(.*?)```", text, re.DOTALL).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    imports = [line for line in lines if line.startswith(("from ", "import "))]
    exec("\n".join(imports), {})
    source = EXAMPLE.read_text()
    missing = [line for line in lines if line not in imports and line.strip() not in source]
    assert not missing, f"README lines not in {EXAMPLE.name}: {missing}"


def test_labels_cover_exactly_the_assistant_messages(example):
    from agrpo_attention.testing import build_tokenizer

    tokenizer = build_tokenizer()
    chat = example.make_conversations(1)[0]
    tokenized = example.tokenize(chat, tokenizer)
    trained = [t for t, label in zip(tokenized["input_ids"], tokenized["labels"], strict=True) if label != -100]
    expected = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
    assert tokenizer.decode(trained) == expected
