"""Fixtures of agrpo-attention's tests: tiny random models, packed rows from agrpo-packing's generator, and the
Triton kernels' interpreter run.

Rows come from agrpo-packing's public API only (`TreeRow`, `agrpo_packing.testing`), as production
rows do. `visibility_from_paths` reads the layout contract literally (every segment attends to its
`kv_index` path, causal aligned bottom-right) so backends can be checked against a dense mask.
`cuda_like` is the CPU seam of the GPU-only varlen path: CI has no GPU, so the backend selection and
dtype handling of `varlen` and `adaptive` run on CPU against a kernel twin that refuses what FA2 refuses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackedRow, PackSample, TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups


def visibility_from_paths(row: PackedRow) -> torch.Tensor:
    """(N, N) bool: query i sees key j, read literally off kv_index / kv_offsets (bottom-right causal)."""
    n = row.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for s in range(row.num_segments):
        q0, q1 = int(row.q_offsets[s]), int(row.q_offsets[s + 1])
        path = row.kv_index[int(row.kv_offsets[s]) : int(row.kv_offsets[s + 1])]
        for t in range(q1 - q0):
            mask[q0 + t, path[: len(path) - (q1 - q0) + t + 1]] = True
    return mask


def seeded_samples(seed: int, *, vocab: int = 5, prompts: int = 2, rollouts: int = 4, longest: int = 70):
    """GRPO samples with multi-turn rollouts and reconcile forks; a small vocab adds accidental sharing."""
    shape = GroupShape(
        num_prompts=prompts,
        rollouts_per_prompt=rollouts,
        prompt_tokens=(3, longest // 2),
        completion_tokens=(1, longest),
        multi_turn_frac=0.5,
        tool_tokens=(1, 8),
        fork_frac=0.7,
        vocab_size=vocab,
    )
    return random_grpo_groups(shape, seed=seed)


def seeded_row(seed: int, *, share: bool = True, **shape) -> PackedRow:
    row = TreeRow(0, share_prefixes=share)
    row.extend(seeded_samples(seed, **shape))
    return row.pack()


def half_only_varlen_kernel(self, q, k, v, layout, *, scaling, softcap, window=None):
    """CPU twin of torch's varlen_attn (FA2): same contract (causal bottom-right, a window of `window` keys back
    as FA2's window_size=(window - 1, 0)), and the same refusal of anything but one fp16/bf16 dtype for q, k and
    v (the GPU error the twin stands in for is quoted)."""
    from agrpo_attention._backends.cascade import _math_forward

    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(
            f"FlashAttention only supports fp16 and bf16 data type (q {q.dtype}, k {k.dtype}, v {v.dtype})"
        )
    if window is None:
        return _math_forward(q, k, v, layout.q_offsets, layout.kv_offsets, True, scaling)[0]
    groups, outs = q.shape[1] // k.shape[1], []
    for s in range(layout.num_segments):
        q_s = q[int(layout.q_offsets[s]) : int(layout.q_offsets[s + 1])].transpose(0, 1).float()
        keys = slice(int(layout.kv_offsets[s]), int(layout.kv_offsets[s + 1]))
        k_s, v_s = (x[keys].transpose(0, 1).repeat_interleave(groups, 0).float() for x in (k, v))
        scores = q_s @ k_s.transpose(1, 2) * scaling
        lq, lk = scores.shape[-2:]
        ahead = torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)[None, :]  # query depth - key depth
        scores = scores.masked_fill((ahead < 0) | (ahead > window - 1), float("-inf"))
        outs.append((scores.softmax(-1) @ v_s).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


@pytest.fixture
def cuda_like(monkeypatch):
    """`varlen`, and so `adaptive`, runnable on CPU through `half_only_varlen_kernel`."""
    from agrpo_attention._backends.varlen import VarlenBackend

    monkeypatch.setattr(VarlenBackend, "unavailable_reason", lambda self, device: None)
    monkeypatch.setattr(VarlenBackend, "_kernel", half_only_varlen_kernel)


def shared_row(prompt_tokens: int = 40, completions: int = 8) -> PackedRow:
    """One long prompt under many short completions: K/V path tokens per packed token ~5 (adaptive: flex)."""
    row = TreeRow(0)
    for c in range(completions):
        ids = np.concatenate([np.arange(prompt_tokens) % 500 + 1, [c + 1, c + 2, c + 3]])
        mask = np.arange(ids.size) >= prompt_tokens
        row.add(
            PackSample(
                input_ids=ids,
                trained_mask=mask,
                group_id=0,
                advantages=np.ones(3),
                sampler_logprobs=np.zeros(3),
            )
        )
    return row.pack()


class Trees:
    """The helpers above, handed to tests as one fixture (test modules cannot import each other here)."""

    visibility_from_paths = staticmethod(visibility_from_paths)
    seeded_samples = staticmethod(seeded_samples)
    random_row = staticmethod(seeded_row)
    shared_row = staticmethod(shared_row)


@pytest.fixture(scope="session")
def trees() -> type[Trees]:
    return Trees


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer(512)


@pytest.fixture(scope="session")
def tiny_dense(tiny_tokenizer):
    return build_model(TinyModelSpec(kind="qwen3", num_layers=2), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_hybrid(tiny_tokenizer):
    return build_model(TinyModelSpec(kind="hybrid", num_layers=4), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_next(tiny_tokenizer):
    """Qwen3-Next's layout: fused Gated DeltaNet projections, gated attention, MoE with a shared expert."""
    return build_model(TinyModelSpec(kind="qwen3_next", num_layers=4), tiny_tokenizer)


@pytest.fixture(scope="session")
def triton_interpreter_cases() -> dict:
    """The errors of agrpo's Triton kernels against their PyTorch definitions, {"delta_rule": ...,
    "path_conv": ...} (`delta_rule_triton_cases.py`, `path_conv_triton_cases.py`), from one fresh interpreter
    with TRITON_INTERPRET=1 (it must be set before triton is imported; one process pays the imports once)."""
    program = (
        "import json, delta_rule_triton_cases as d, path_conv_triton_cases as p; "
        "print(json.dumps({'delta_rule': d.cases(), 'path_conv': p.cases()}))"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).parent)  # fmt: skip
    assert run.returncode == 0, f"the interpreter run failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])
