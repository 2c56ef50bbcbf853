"""The Triton path convolution on CPU through Triton's interpreter, against the PyTorch definition: the errors.

Run with `delta_rule_triton_cases.py` by the `triton_interpreter_cases` fixture (`conftest.py`) in a fresh
interpreter (TRITON_INTERPRET must be set before triton is first imported); `python path_conv_triton_cases.py`
alone prints the same. `cases()` returns one dict: per case the largest absolute
difference of the output and of the gradients of x, weight and bias from `path_conv` run in fp64, divided by
the largest absolute value of that fp64 result. Rows: a chain longer than one backward program (128
tokens), a wide fork (one prompt, eight completions, one of them a single token), a deep fork (segments
shorter than the window), a plain row (roots only) and a random multi-turn GRPO row with reconcile forks;
channels not a multiple of the 128-channel block; 4 taps (Qwen3.5) and 3, with and without bias.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json

import torch
from delta_rule_triton_cases import tree_row, tree_rows

from agrpo_attention._deltanet_plan import build_deltanet_plan
from agrpo_attention._path_conv_triton import triton_path_conv
from agrpo_attention._tree_deltanet import path_conv
from conftest import seeded_row

NAMES = ("out", "dx", "dweight", "dbias")


def _values_and_grads(run, x, conv, dtype, weight_dtype):
    layer = torch.nn.Conv1d(x.shape[1], x.shape[1], conv.weight.shape[-1], groups=x.shape[1], bias=False)
    layer.weight = torch.nn.Parameter(conv.weight.detach().to(weight_dtype))
    if conv.bias is not None:
        layer.bias = torch.nn.Parameter(conv.bias.detach().to(weight_dtype))
    leaves = [x.detach().to(dtype).requires_grad_(), *layer.parameters()]
    out = run(leaves[0], layer)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), leaves)
    return [out.detach().double(), *(g.double() for g in grads)]


def case(row, channels: int, taps: int, bias: bool, dtype=torch.float32) -> dict:
    """Relative max errors of the Triton kernels (x in `dtype`, fp32 weights as under autocast) against fp64
    `path_conv` on the same values."""
    plan = build_deltanet_plan(row, taps, "cpu")
    gen = torch.Generator().manual_seed(row.num_tokens + channels)
    x = torch.randn(row.num_tokens, channels, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv1d(channels, channels, taps, groups=channels, bias=bias).double()
    x = x.to(dtype).double()  # the truth sees the values the kernels see
    truth = _values_and_grads(
        lambda x, c: path_conv(x, c, plan, "silu"), x, conv, torch.float64, torch.float64
    )
    triton = lambda x, c: triton_path_conv(x, c, plan.conv, "silu")  # noqa: E731
    got = _values_and_grads(triton, x, conv, dtype, torch.float32)
    errors = {
        name: (a - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
        for name, a, t in zip(NAMES, got, truth, strict=False)
    }
    return errors | {"forks": int(plan.conv.fork_tokens.shape[0]), "tokens": row.num_tokens}


def qwen3_5_layer():
    """transformers' Qwen3.5 Gated DeltaNet, separate projections, two value heads per key head."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_conv_kernel_dim=4)  # fmt: skip
    return Qwen3_5GatedDeltaNet(config, layer_idx=0)


def qwen3_next_layer():
    """transformers' Qwen3-Next Gated DeltaNet: fused in_proj_qkvz / in_proj_ba grouped per key head."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3NextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4)  # fmt: skip
    return Qwen3NextGatedDeltaNet(config, layer_idx=0)


def layer_case(build) -> dict:
    """`tree_deltanet_forward` of a real layer (`build()`: either projection layout, grouped value heads) with
    kernel "triton", its convolution switched to the Triton one as on CUDA (so q/k/v reach the delta rule as
    strided views of the conv output), against the same layer with "torch" in fp64: relative max errors of the
    output and of the gradients of the hidden states and of every parameter, for "triton" in fp32 and, as the
    yardstick, "torch" in fp32."""
    import agrpo_attention._tree_deltanet as tree_deltanet

    layer = build()
    row = seeded_row(4, vocab=3, prompts=1, rollouts=3, longest=24)
    plan = build_deltanet_plan(row, int(layer.conv1d.weight.shape[-1]), "cpu")
    hidden = torch.randn(
        1, row.num_tokens, layer.out_proj.out_features, generator=torch.Generator().manual_seed(5)
    )
    conv_on_cpu = tree_deltanet.layer_path_conv
    tree_deltanet.layer_path_conv = lambda mixed, module, plan, kernel: (
        triton_path_conv(mixed, module.conv1d, plan.conv, module.activation)
        if kernel == "triton"
        else conv_on_cpu(mixed, module, plan, kernel)
    )

    def run(kernel: str, dtype):
        layer.to(dtype).zero_grad(set_to_none=True)
        x = hidden.to(dtype, copy=True).requires_grad_()
        out = tree_deltanet.tree_deltanet_forward(layer, x, plan, kernel)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        (out.double() * weights).sum().backward()
        named = {"out": out, "dhidden": x.grad} | {f"d{n}": p.grad for n, p in layer.named_parameters()}
        return {n: t.detach().double().clone() for n, t in named.items()}

    try:
        truth = run("torch", torch.float64)
        errors = {}
        for label, kernel in (("torch", "torch"), ("triton", "triton")):
            got = run(kernel, torch.float32)
            errors[label] = {
                n: (got[n] - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
                for n, t in truth.items()
            }
    finally:
        tree_deltanet.layer_path_conv = conv_on_cpu
    return errors | {"forks": int(plan.conv.fork_tokens.shape[0]), "levels": len(plan.levels)}


def opcheck_case() -> dict:
    row = tree_rows()["wide"]
    plan = build_deltanet_plan(row, 4, "cpu")
    x = torch.randn(row.num_tokens, 6, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(6, 1, 4, requires_grad=True)
    tables = plan.conv
    args = (
        x,
        weight,
        None,
        tables.predecessors,
        tables.fork_tokens,
        tables.fork_offsets,
        tables.fork_successors,
    )
    return torch.library.opcheck(torch.ops.agrpo.path_conv_forward.default, (*args, True))


def cases() -> dict:
    rows = tree_rows()
    plain = tree_row([[1, 2, 3] * 7, [4, 5] * 30, [6]])  # three roots, nothing shared
    return {
        "chain": case(rows["chain"], 20, 4, False),
        "wide": case(rows["wide"], 136, 4, True),
        "deep": case(rows["deep"], 20, 4, False),
        "deep_3_taps": case(rows["deep"], 12, 3, True),
        "plain": case(plain, 20, 4, False),
        "grpo": case(seeded_row(7, vocab=3), 20, 4, False),
        "bf16": case(rows["wide"], 20, 4, False, torch.bfloat16),
        "layer": layer_case(qwen3_5_layer),
        "layer_qwen3_next": layer_case(qwen3_next_layer),
        "opcheck": opcheck_case(),
    }


def main() -> None:
    print(json.dumps(cases()))


if __name__ == "__main__":
    main()
