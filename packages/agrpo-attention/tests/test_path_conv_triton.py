"""agrpo's Triton path convolution equals the PyTorch definition (`path_conv`), run on CPU through Triton's
interpreter.

The kernels run in the interpreter run of the `triton_interpreter_cases` fixture (`path_conv_triton_cases.py`)
and each test reads its case from it. Errors are the largest deviation from `path_conv` in fp64, relative to
the largest value: the fp32 kernels sit near 2e-7, so 1e-5 fails on any missed successor, tap or mask; bf16
inputs round their output and input gradient once (2^-8). Speed, and that the kernels build for sm_90, are
checked by `tools/bench/train_step/delta_rule_kernels.py` and `delta_rule_compile.py`.
"""

from __future__ import annotations

import pytest

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cases(triton_interpreter_cases) -> dict:
    return triton_interpreter_cases["path_conv"]


def _errors(case: dict) -> dict:
    return {k: v for k, v in case.items() if k in ("out", "dx", "dweight", "dbias")}


@pytest.mark.parametrize("name", ["chain", "plain", "wide", "deep", "deep_3_taps", "grpo"])
def test_values_and_gradients_match_the_definition(cases, name):
    """Chains longer than one backward program, roots only, forks whose children are not laid out after
    their parent, segments shorter than the window, 3 and 4 taps, bias, channels past one block."""
    worst = {k: v for k, v in _errors(cases[name]).items() if v > TOLERANCE}
    assert not worst, f"{name}: errors {worst} above {TOLERANCE}"


def test_forks_are_exercised(cases):
    assert cases["chain"]["forks"] == cases["plain"]["forks"] == 0
    assert min(cases[name]["forks"] for name in ("wide", "deep", "grpo")) > 0
    assert "dbias" in cases["wide"] and "dbias" not in cases["chain"]


def test_bf16_inputs_round_once(cases):
    assert max(_errors(cases["bf16"]).values()) < 1e-2


@pytest.mark.parametrize("layout", ["layer", "layer_qwen3_next"])
def test_a_layer_with_both_triton_kernels_matches_the_torch_layer(cases, layout):
    """A Qwen3.5 or Qwen3-Next Gated DeltaNet layer's tree forward with the Triton convolution and the fused Triton delta rule
    (q/k/v as strided views of the conv output, grouped value heads), against fp64: within 1e-5, or as close
    as the PyTorch layer in fp32 is (the gate parameters' gradients cancel in fp32 either way)."""
    assert cases[layout]["forks"] > 0 and cases[layout]["levels"] > 1
    torch_errors, triton_errors = cases[layout]["torch"], cases[layout]["triton"]
    worse = {n: (e, torch_errors[n]) for n, e in triton_errors.items() if e > max(1e-5, 3 * torch_errors[n])}
    assert not worse, f"Triton layer errors (and the PyTorch layer's) above tolerance: {worse}"
    projection = "din_proj_qkvz.weight" if layout == "layer_qwen3_next" else "din_proj_qkv.weight"
    assert {"dhidden", "dconv1d.weight", "dA_log", projection} <= set(triton_errors)


def test_custom_op_passes_opcheck(cases):
    assert set(cases["opcheck"].values()) == {"SUCCESS"}, cases["opcheck"]
