"""Compiled Gated DeltaNet layers on CPU, through Triton's interpreter: what `test_layer_region.py` asserts.

Run in a fresh interpreter by the test (TRITON_INTERPRET must be set before triton is first imported; it is set here,
first thing); `python deltanet_region_case.py` alone prints the same JSON. The CPU seam of the GPU path: agrpo's
Triton kernels (deltanet_kernel "triton", refused off CUDA in production) are let run on CPU, the interpreter
executing them in numpy, so a tiny Qwen3.5-style hybrid's decoder layers run as the trainer's `LayerRegions`
compile them (aot_eager: dynamo, AOT autograd and the partitioner, nothing lowered; full checkpointing, as on the
H200) next to the same regions run eagerly. Rows of two sizes and shapes, fp32, no autocast. Reports which layers
compiled, the graphs and graph breaks dynamo counted, and the largest relative log-prob and gradient differences.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import copy
import json

from torch._dynamo.utils import counters

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer, let_triton_run_on_cpu
from agrpo_packing import TreeRow
from agrpo_packing.testing import GroupShape, random_grpo_groups
from agrpo_trainer._layer_region import LayerRegions, RegionSettings


def row(seed: int, rollouts: int):
    shape = GroupShape(num_prompts=1, rollouts_per_prompt=rollouts, prompt_tokens=(10, 30),
                       completion_tokens=(3, 20), vocab_size=512)  # fmt: skip
    tree = TreeRow(0)
    tree.extend(random_grpo_groups(shape, seed=seed))
    return tree.pack()


GATE_PARAMETERS = ("A_log", "dt_bias", "in_proj_a")
"""The Gated DeltaNet gate parameters, whose fp32 gradient cancels catastrophically in the chunked delta rule (any
two summation orders differ by ~1e-4 relative; agrpo-attention's precision notes): compared on their own bound."""


def scores_and_grads(model, packed):
    model.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, packed)
    (logprobs * packed.advantages).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def case() -> dict:
    let_triton_run_on_cpu()
    eager = build_model(TinyModelSpec(kind="hybrid", num_layers=4, seed=5), build_tokenizer()).train()
    enable_tree_attention(eager, "reference", deltanet_kernel="triton")
    compiled = copy.deepcopy(eager)
    settings = RegionSettings(compile=True, compile_backend="aot_eager", checkpointing="full")
    regions = LayerRegions(settings).install(compiled)
    LayerRegions(RegionSettings(compile=False, checkpointing="full")).install(eager)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    logprob_diff, grad_diff, gate_diff, tokens, grads = 0.0, 0.0, 0.0, [], 0
    for seed, rollouts in ((0, 2), (1, 4)):
        packed = row(seed, rollouts)
        tokens.append(packed.num_tokens)
        lp_c, grads_c = scores_and_grads(compiled, packed)
        lp_e, grads_e = scores_and_grads(eager, packed)
        assert grads_c.keys() == grads_e.keys()
        grads = len(grads_e)
        logprob_diff = max(logprob_diff, float((lp_c - lp_e).abs().max()))
        for name, g in grads_e.items():
            relative = float((grads_c[name] - g).norm() / g.norm().clamp_min(1e-12))
            if name.removesuffix(".weight").rsplit(".", 1)[-1] in GATE_PARAMETERS:
                gate_diff = max(gate_diff, relative)
            else:
                grad_diff = max(grad_diff, relative)
    return {
        "compiled_layers": [r.compiled for r in regions.regions],
        "graphs": counters["stats"]["unique_graphs"] - graphs,
        "graph_breaks": sum(counters["graph_break"].values()) - breaks,
        "break_reasons": sorted(counters["graph_break"]),
        "logprob_diff": logprob_diff,
        "grad_rel_diff": grad_diff,
        "gate_grad_rel_diff": gate_diff,
        "tokens": tokens,
        "parameters_with_grad": grads,
    }


if __name__ == "__main__":
    print(json.dumps(case()))
