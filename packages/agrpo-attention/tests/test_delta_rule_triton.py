"""agrpo's Triton delta rule equals the PyTorch rule, run on CPU through Triton's interpreter.

The kernels run in one fresh interpreter (`delta_rule_triton_cases.py` through the `triton_interpreter_cases`
fixture, TRITON_INTERPRET=1 set before triton is imported; about 60 s on 2 idle cores with the path
convolution's cases) and each test reads its case from that run. Every error
is the largest deviation from the PyTorch rule in fp64, relative to the largest value: fp32 kernels sit
at ~1e-6, as the PyTorch rule in fp32 does, so 1e-5 fails on any real mistake (a wrong mask, a missing
gradient term, a state not handed on). The interpreter computes every dot in fp32, so tf32 rounding,
races between programs and speed are checked on the H200 (`tools/bench/train_step/gpu_delta_rule.sh`);
that the kernels compile for sm_90 is checked on CPU by `tools/bench/train_step/delta_rule_compile.py`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from agrpo_attention._delta_rule_triton import triton_unavailable_reason

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cases(triton_interpreter_cases) -> dict:
    return triton_interpreter_cases["delta_rule"]


def assert_close_to_definition(case: dict) -> None:
    worst = {name: error for name, error in case["triton"].items() if error > TOLERANCE}
    assert not worst, f"Triton errors {worst} above {TOLERANCE}; the PyTorch rule in fp32 has {case['torch']}"


def test_varlen_values_and_gradients_match_including_initial_states(cases):
    """1-, 64-, 64- and 20-token sequences, each from its own state; grouped heads, dims 24 and 40."""
    assert_close_to_definition(cases["varlen"])
    assert set(cases["varlen"]["triton"]) == {"out", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"}


@pytest.mark.parametrize(("tree", "levels"), [("chain", 1), ("wide", 2), ("deep", 5)])
def test_tree_delta_rule_matches_level_by_level(cases, tree, levels):
    """Each level's segments start from their parents' final states; gradients flow back across levels."""
    assert cases[tree]["levels"] == levels
    assert_close_to_definition(cases[tree])


def test_half_inputs_give_half_output_and_fp32_state(cases):
    assert cases["bf16"]["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert cases["bf16"]["out"] < 1e-2 and cases["bf16"]["final"] < TOLERANCE


def test_torch_compile_traces_the_custom_op_with_its_gradients(cases):
    assert cases["compiled"]["max_diff"] < TOLERANCE


def test_custom_op_passes_opcheck(cases):
    assert set(cases["opcheck"].values()) == {"SUCCESS"}, cases["opcheck"]


def test_unavailable_off_cuda_and_package_imports_without_triton():
    assert "CUDA" in triton_unavailable_reason(torch.device("cpu"))
    probe = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'triton': raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import agrpo_attention._tree_deltanet as t\n"
        "print(t.resolve_delta_rule_kernel('auto', t.torch.device('cpu')))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["torch"]
