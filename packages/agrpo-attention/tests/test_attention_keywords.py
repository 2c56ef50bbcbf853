"""Nothing that changes attention is dropped: every keyword transformers' model code hands an attention
function is classified (HANDLED, INERT or REFUSED), refused and unknown keywords raise, and the features that
reach attention through masks or module attributes are refused before any forward (`model_attention_refusals`).

The enumeration reads the installed transformers' `models/*/modeling_*.py` with `ast`, parsing only the
functions that mention an attention interface (whole files take ~10 s on a shared CPU; these, under one)."""

from __future__ import annotations

import ast
import copy
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest
import torch

from agrpo_attention import UnsupportedModelError
from agrpo_attention._attention_keywords import (
    CLASSIFIED,
    HANDLED,
    INERT,
    REFUSED,
    check_attention_keywords,
    model_attention_refusals,
)

SUPPORTED_FAMILIES: dict[str, frozenset[str]] = {
    "qwen3": frozenset({"dropout", "scaling", "sliding_window"}),
    # The vision encoder's calls (bidirectional, varlen): refused by name, as under tree attention they must be.
    "qwen3_5": frozenset(
        {"attention_mask", "cu_seq_lens_k", "cu_seq_lens_q", "dropout", "is_causal", "max_length_k"}
        | {"max_length_q", "scaling"}
    ),
    "qwen3_next": frozenset({"dropout", "scaling"}),
    "qwen3_moe": frozenset({"dropout", "scaling", "sliding_window"}),
    "olmoe": frozenset({"dropout", "scaling", "sliding_window"}),
    "mixtral": frozenset({"dropout", "scaling", "sliding_window"}),
    "llama": frozenset({"dropout", "scaling"}),
    "mistral": frozenset({"dropout", "scaling", "sliding_window"}),
    "gemma2": frozenset({"dropout", "scaling", "sliding_window", "softcap"}),
    "gemma3": frozenset({"dropout", "scaling", "sliding_window"}),
    "gpt_oss": frozenset({"dropout", "s_aux", "scaling", "sliding_window"}),
}
"""The keywords transformers 5.24's attention callers of each supported family pass (all its modeling files)."""

_INTERFACE_POSITIONALS = 5
"""module, query, key, value, attention_mask: a further positional argument would be an unnamed keyword."""
_MENTION = re.compile(r"attention_interface|ALL_ATTENTION_FUNCTIONS")
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _function_sources(source: str) -> list[str] | None:
    """The source of each function that mentions an attention interface, parseable alone (a body indented
    under a dummy class); None when a mention lies outside any function (then parse the whole file)."""
    lines = source.splitlines()
    starts: set[int] = set()
    for row, line in enumerate(lines):
        stripped = line.lstrip()
        if not _MENTION.search(line) or stripped.startswith(("from ", "import ", "#")):
            continue
        enclosing = (
            i for i in range(row, -1, -1) if (m := _DEF.match(lines[i])) and len(m[1]) < _indent(line)
        )
        start = next(enclosing, None)
        if start is None:
            return None
        starts.add(start)
    sources = []
    for start in sorted(starts):
        depth = _indent(lines[start])
        end = start + 1
        while end < len(lines):
            stripped = lines[end].strip()
            if stripped and not stripped.startswith((")", "]", "}", "#")) and _indent(lines[end]) <= depth:
                break
            end += 1
        body = "\n".join(lines[start:end])
        sources.append(f"class _:\n{body}" if depth else body)
    return sources


def _mentions_registry(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "ALL_ATTENTION_FUNCTIONS" for n in ast.walk(node))


def _dict_keys(node: ast.AST) -> set[str] | None:
    """The string keys of a dict literal or dict(...) call; None for anything else."""
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg}
    return None


def _call_keywords(tree: ast.AST) -> list[set[str]]:
    """The keyword names of each attention-interface call under `tree`: names bound from
    ALL_ATTENTION_FUNCTIONS (and `attention_interface`) called as `name(...)` or `self.name(...)`, and direct
    `ALL_ATTENTION_FUNCTIONS[...](...)`; `**d` of a dict literal built in the same function adds its keys."""
    callees, dicts = {"attention_interface"}, defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                if _mentions_registry(node.value):
                    callees.add(name)
                elif (keys := _dict_keys(node.value)) is not None:
                    dicts[name] |= keys
                key = target.slice if isinstance(target, ast.Subscript) else None  # d["name"] = ...
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and isinstance(target.value, ast.Name)
                ):
                    dicts[target.value.id].add(key.value)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get_interface":
            continue  # the lookup, not the call
        named = (isinstance(func, ast.Name) and func.id in callees) or (
            isinstance(func, ast.Attribute) and func.attr in callees
        )
        if not (named or _mentions_registry(func)):
            continue
        keywords = {f"<positional {i}>" for i in range(_INTERFACE_POSITIONALS, len(node.args))}
        for keyword in node.keywords:
            if keyword.arg is not None:
                keywords.add(keyword.arg)
            elif (keys := _dict_keys(keyword.value)) is not None:
                keywords |= keys
            elif isinstance(keyword.value, ast.Name):
                keywords |= dicts.get(keyword.value.id, set())
        calls.append(keywords)
    return calls


@cache
def attention_callers() -> dict[str, frozenset[str]]:
    """{model family: keywords its modeling files pass to attention interfaces}, installed transformers."""
    import transformers

    found: dict[str, set[str]] = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        source = path.read_text(encoding="utf-8")
        if not _MENTION.search(source):
            continue
        sources = _function_sources(source)
        try:
            trees = [ast.parse(s) for s in sources] if sources is not None else [ast.parse(source)]
        except SyntaxError:  # a function cut short by an oddly indented line: read the whole file
            trees = [ast.parse(source)]
        for tree in trees:
            for keywords in _call_keywords(tree):
                found.setdefault(path.parent.name, set()).update(keywords)
    return {family: frozenset(keywords) for family, keywords in found.items()}


def _class_of(name: str) -> str:
    return (
        "HANDLED" if name in HANDLED else "INERT" if name in INERT else "REFUSED" if name in REFUSED else "??"
    )


def test_transformers_is_the_surveyed_version():
    import transformers

    assert transformers.__version__.startswith("5.24"), (
        f"the keyword survey is of transformers 5.24, installed is {transformers.__version__}: rerun "
        "test_every_keyword_of_every_attention_caller_is_classified and review new keywords"
    )


def test_every_keyword_of_every_attention_caller_is_classified():
    callers = attention_callers()
    assert len(callers) > 300, f"found only {len(callers)} families calling an attention interface"
    unclassified: dict[str, list[str]] = defaultdict(list)
    for family, keywords in sorted(callers.items()):
        for name in keywords - CLASSIFIED:
            unclassified[name].append(family)
    table = "\n".join(f"  {name:24} {', '.join(fams[:8])}" for name, fams in sorted(unclassified.items()))
    assert not unclassified, f"attention keywords neither handled, inert nor refused:\n{table}"


def test_supported_families_pass_exactly_the_surveyed_keywords():
    callers = attention_callers()
    rows, failed = [], False
    for family, expected in SUPPORTED_FAMILIES.items():
        passed = callers.get(family, frozenset())
        ok = bool(passed) and passed == expected and passed <= CLASSIFIED
        failed |= not ok
        classes = ", ".join(f"{name}:{_class_of(name)}" for name in sorted(passed)) or "NO CALLER FOUND"
        extra = f"  (expected {sorted(expected)})" if passed != expected else ""
        rows.append(f"  {'ok  ' if ok else 'FAIL'} {family:11} {classes}{extra}")
    assert not failed, "supported families' attention keywords:\n" + "\n".join(rows)


def test_no_class_overlaps():
    assert not (HANDLED & INERT) and not (HANDLED & REFUSED.keys()) and not (INERT & REFUSED.keys())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_keyword_with_a_value_is_refused_by_name(name):
    value = False if name == "is_causal" else torch.ones(2, dtype=torch.long)
    with pytest.raises(UnsupportedModelError, match=name):
        check_attention_keywords("Attn", {name: value})


def test_refused_keywords_that_ask_for_nothing_pass():
    check_attention_keywords("Attn", dict.fromkeys(REFUSED))  # all None
    check_attention_keywords("Attn", {"is_causal": True, "max_length_q": 0, "cu_seq_lens_q": None})


def test_an_unknown_keyword_is_refused_and_reported():
    with pytest.raises(UnsupportedModelError, match=r"made_up_bias=<tensor \(2,\)>.*report it"):
        check_attention_keywords("Attn", {"position_ids": torch.zeros(2), "made_up_bias": torch.zeros(2)})
    check_attention_keywords("Attn", {"made_up_bias": None})


def test_inert_keywords_and_the_tree_plan_pass():
    check_attention_keywords("Attn", dict.fromkeys(INERT, True) | {"tree_plan": object(), "dropout": 0.0})


def test_a_handled_keyword_left_over_is_refused_as_dropped():
    """Left over means the attention function did not take it by name: it would be dropped (gpt-oss sinks)."""
    with pytest.raises(UnsupportedModelError, match=r"s_aux=<tensor \(2,\)>.*did not take"):
        check_attention_keywords("GptOssAttention", {"s_aux": torch.zeros(2)})


def test_what_tiny_models_hand_attention_at_runtime_passes(tiny_dense):
    """The leftovers of a real forward with token_logprobs' kwargs, seen by a spy that takes what tree
    attention takes by name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    leftovers: set[str] = set()

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
            sliding_window=None, s_aux=None, tree_plan=None, **kwargs):  # fmt: skip
        leftovers.update(kwargs)
        check_attention_keywords(type(module).__name__, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)

    AttentionInterface.register("agrpo_keyword_spy", spy)
    model = copy.deepcopy(tiny_dense)
    model.set_attn_implementation("agrpo_keyword_spy")
    ids = torch.arange(6)[None] + 10
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(6)[None], use_cache=False, tree_plan=object(),
              output_router_logits=True, output_attentions=True, output_hidden_states=True,
              moe_routes=object())  # fmt: skip
    assert {"position_ids", "use_cache", "moe_routes"} <= leftovers <= INERT


def _tiny(config_class, **fields):
    from transformers import AutoModelForCausalLM

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(**(shape | fields)))


def test_plain_tiny_models_have_nothing_refused(tiny_dense, tiny_hybrid):
    assert model_attention_refusals(tiny_dense) == []
    assert model_attention_refusals(tiny_hybrid) == []


def test_implemented_features_are_not_refused():
    """Sinks and sliding windows (gpt-oss), softcapping and sliding windows (Gemma 2)."""
    from transformers import Gemma2Config, GptOssConfig

    assert model_attention_refusals(_tiny(GptOssConfig, num_local_experts=2, num_experts_per_tok=1)) == []
    assert model_attention_refusals(_tiny(Gemma2Config, attn_logit_softcapping=50.0)) == []


def _one_reason_names(reasons: list[str], *words: str) -> None:
    assert any(all(word in reason for word in words) for reason in reasons), reasons


def test_llama4_chunked_attention_is_refused():
    from transformers import Llama4TextConfig

    model = _tiny(Llama4TextConfig, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=16)
    _one_reason_names(model_attention_refusals(model), "chunked attention", "attention_chunk_size=16")
    unchunked = _tiny(
        Llama4TextConfig, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=None
    )
    assert model_attention_refusals(unchunked) == []


def test_gemma3_bidirectional_attention_is_refused():
    from transformers import Gemma3TextConfig

    reasons = model_attention_refusals(_tiny(Gemma3TextConfig, use_bidirectional_attention=True))
    _one_reason_names(reasons, "use_bidirectional_attention")
    _one_reason_names(reasons, "is_causal=False", "layers.0.self_attn")


def test_attention_dropout_in_the_config_is_refused(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    model.config.attention_dropout = 0.1
    _one_reason_names(
        model_attention_refusals(model), "attention_dropout=0.1", "set config.attention_dropout=0"
    )


def test_a_non_causal_attention_module_is_refused_by_name(tiny_dense):
    model = copy.deepcopy(tiny_dense)
    model.model.layers[1].self_attn.is_causal = False
    _one_reason_names(model_attention_refusals(model), "1 attention modules", "model.layers.1.self_attn")
