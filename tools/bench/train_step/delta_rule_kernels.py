"""agrpo's Triton delta rule and path convolution at the hybrid's full size: parity with fp64, then milliseconds.

Run (GPU): `python3 -m tools.bench.train_step.delta_rule_kernels [--launch w4] [--quick] [--json PATH]`; the
H200 script is `gpu_delta_rule.sh`. For the first tree row and the first plain row at each packing ratio
(16k-token rows of the train-step benchmark's GRPO samples; `qwen3.5-hybrid-2b`'s 16 key and 16 value heads of
128 and 6144 conv channels; bf16 q/k/v/beta and fp32 gate, as a layer hands them over under autocast):
- parity (tree row): `tree_delta_rule` with "torch" (fp32 math) and "triton" (tf32 dots, fp32 state) on these
  inputs, and "triton" on their fp32 upcast ("tf32x3" dots), each against "torch" on the fp64 upcast; the
  output and all five input gradients, as relative L2 error, max abs error, and max abs error over max abs
  value; and the Triton path convolution (bf16 input, fp32 weight) against `path_conv` in fp64 (output,
  input and weight gradients). PASS: every relative L2 error of "triton" and of the convolution below 1e-2
  (bf16 outputs and gradients round at ~2e-3: "torch bf16" shows that floor);
- milliseconds per layer per 16k tokens, per row (CUDA events, median of `--repeats` after a warm-up): the
  Triton delta rule forward (grad enabled) and forward + backward, each split into the Triton kernels' own
  device time (profiler, one call) and everything else in the call ("other": allocations, launches, any
  PyTorch op between kernels); the path convolution forward + backward, Triton and the PyTorch definition;
  the whole Gated DeltaNet layer (`tree_deltanet_forward` of a real layer, projections to output
  projection, the Triton conv and rule) forward + backward; each kernel's ms in one forward + backward.
  Tree and plain rows side by side say whether a tree row costs more per token than a plain one.
`--launch` picks a preset of the kernels' launch table (`LAUNCHES`); `--quick` checks and times the bf16
Triton path of the tree row only; `--with-torch` adds the PyTorch rule's times. CPU smoke test:
`TRITON_INTERPRET=1 ... --tiny` (tiny shape and rows). Does not know the optimizer or the rest of the model;
the whole-step numbers are `__main__.py`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from agrpo_attention import build_tree_plan, enable_tree_attention
from agrpo_attention._path_conv_triton import triton_path_conv
from agrpo_attention._tree_deltanet import path_conv, tree_delta_rule, tree_deltanet_forward
from agrpo_packing import PackedRow, PackingConfig, PackSample, Planner

from ..tree_attention.model_shapes import build_random_model
from .data import grpo_samples
from .delta_rule import layer_inputs

MODEL = "qwen3.5-hybrid-2b"
ROW_TOKENS = 16384
NAMES = ("out", "dq", "dk", "dv", "dg", "dbeta")
VARIANTS = {
    "torch bf16": ("torch", None),
    "triton bf16": ("triton", None),
    "triton fp32": ("triton", torch.float32),
}
"""label -> (kernel, input dtype; None: the layer's own, bf16 q/k/v/beta and fp32 g)."""
PASS_REL_L2 = 1e-2
FORWARD_KERNELS = ("qk_norm_forward", "wy_forward", "state_forward", "output_forward")
LAUNCHES = {
    "default": {},
    "w4": {"*": 4},
    "w8": {"*": 8},
    "w2": {"*": 2},
}
"""Presets of num_warps per kernel ("*": every kernel) over `_delta_rule_triton_forward.LAUNCH`; "default" is
the table itself (4 warps, 8 for `wy_backward` and `dqk_backward`), "w4" the all-4-warp table of the first
H200 round (2026-12-03, parity passed)."""


def apply_launch(preset: str) -> dict[str, tuple[int, int]]:
    """Set the Triton kernels' launch table to `preset` (num_stages kept); returns the table now in force."""
    from agrpo_attention._delta_rule_triton_forward import LAUNCH

    warps = LAUNCHES[preset]
    for name, (num_warps, num_stages) in LAUNCH.items():
        LAUNCH[name] = (warps.get(name, warps.get("*", num_warps)), num_stages)
    return dict(LAUNCH)


def first_row(samples: list[PackSample], budget: int, *, share_prefixes: bool = True) -> PackedRow:
    """The planner's first row of `samples`, as `step.plan_rows` plans it (agrpo-packing alone: this module
    needs neither agrpo-trainer nor its dependencies)."""
    planner = Planner(PackingConfig(token_budget=budget, share_prefixes=share_prefixes, num_ranks=1))
    for sample in samples:
        for batch in planner.add(sample):
            return batch.pack()[0]
    return planner.flush().pack()[0]


def _values_and_grads(kernel: str, inputs, plan, dtype) -> list[torch.Tensor]:
    """Output and input gradients of `tree_delta_rule` under fixed random output weights, fp64."""
    leaves = [x.detach().to(dtype or x.dtype).requires_grad_() for x in inputs]
    out = tree_delta_rule(*leaves, plan, kernel)
    generator = torch.Generator(out.device).manual_seed(1)
    weights = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    return [out.detach().double()] + [x.grad.double() for x in leaves]


def parity(plan, inputs, variants: dict) -> dict:
    """Per variant and tensor: (relative L2 error, max abs error, max abs error / max abs value) against fp64
    "torch"."""
    truth = _values_and_grads("torch", inputs, plan, torch.float64)
    result = {}
    for label, (kernel, dtype) in variants.items():
        got = _values_and_grads(kernel, inputs, plan, dtype)
        result[label] = {}
        for name, a, t in zip(NAMES, got, truth, strict=True):
            result[label][name] = _relative_errors(a, t)
        del got
    return result


def _relative_errors(got: torch.Tensor, truth: torch.Tensor) -> tuple[float, float, float]:
    error = (got - truth).abs().max().item()
    return ((got - truth).norm() / truth.norm()).item(), error, error / truth.abs().max().item()


def conv_parity(plan, layer, num_tokens: int) -> dict:
    """The Triton path convolution (bf16 input, the layer's fp32 weight) against `path_conv` in fp64: (relative
    L2, max abs, max rel) of the output and the input and weight gradients."""
    device = layer.conv1d.weight.device
    generator = torch.Generator(device).manual_seed(2)
    mixed = torch.randn(num_tokens, layer.conv1d.weight.shape[0], generator=generator, device=device)
    mixed = mixed.bfloat16()
    reference = torch.nn.Conv1d(mixed.shape[1], mixed.shape[1], layer.conv1d.weight.shape[-1], bias=False,
                                groups=mixed.shape[1]).to(device, torch.float64)  # fmt: skip
    reference.weight.data.copy_(layer.conv1d.weight.detach())
    results = []
    for conv, x, run in ((reference, mixed.double(), lambda x, c: path_conv(x, c, plan, layer.activation)),
                         (layer.conv1d, mixed, lambda x, c: triton_path_conv(x, c, plan.conv, layer.activation))):  # fmt: skip
        x = x.detach().requires_grad_()
        conv.zero_grad(set_to_none=True)
        out = run(x, conv)
        weights = torch.randn(out.shape, generator=torch.Generator(device).manual_seed(3), device=device)
        (out.double() * weights.double()).sum().backward()
        results.append([out.detach().double(), x.grad.double(), conv.weight.grad.double()])
    layer.conv1d.zero_grad(set_to_none=True)
    return {
        n: _relative_errors(a, t)
        for n, a, t in zip(("out", "dx", "dweight"), results[1], results[0], strict=True)
    }


def _seconds(run, repeats: int, device: torch.device) -> float:
    """Median seconds of `run` on the device's timeline (the wall clock on CPU), after one untimed call
    (Triton's compile)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _backward_of(forward):
    def run():
        out = forward()
        out.backward(torch.ones_like(out))

    return run


def kernel_milliseconds(run) -> dict[str, float]:
    """Device milliseconds of each Triton delta-rule kernel in one call of `run`, summed over launches."""
    from torch.profiler import ProfilerActivity, profile

    from agrpo_attention._delta_rule_triton_forward import LAUNCH

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        name = event.name.removesuffix("_kernel")
        if event.device_type == torch.autograd.DeviceType.CUDA and name in LAUNCH:
            total[name] += event.time_range.elapsed_us() / 1e3
    return dict(total)


def _split(total_s: float, kernel_ms: dict, names) -> dict:
    """ms of a call: its total, the sum of the listed kernels' own device time, and the rest ("other")."""
    kernels = sum(v for k, v in kernel_ms.items() if k in names)
    return {"ms": 1e3 * total_s, "kernels_ms": kernels, "other_ms": 1e3 * total_s - kernels}


def row_seconds(model, row, plan, repeats: int, *, quick: bool, with_torch: bool) -> dict:
    """Per 16k tokens of `row`, one layer: the Triton delta rule (fwd, fwd+bwd, split into kernels and other),
    the path convolution (Triton and PyTorch) and the whole layer; seconds ("_s") and milliseconds ("_ms")."""
    device = next(model.parameters()).device
    inputs = layer_inputs(model.config, row.num_tokens, device)
    layer = model.model.layers[0].linear_attn
    hidden = torch.randn(1, row.num_tokens, model.config.hidden_size, device=device, requires_grad=True)
    mixed = torch.randn(row.num_tokens, layer.conv1d.weight.shape[0], device=device, dtype=torch.bfloat16)
    mixed.requires_grad_()
    scale, out = ROW_TOKENS / row.num_tokens, {}

    def rule(kernel="triton"):
        return tree_delta_rule(*inputs, plan.deltanet, kernel)

    def under_autocast(run):
        def wrapped():
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                return run()

        return wrapped

    out["triton_fwd_s"] = scale * _seconds(rule, repeats, device)
    out["triton_fwd_bwd_s"] = scale * _seconds(_backward_of(rule), repeats, device)
    if device.type == "cuda":
        ms = kernel_milliseconds(_backward_of(rule))
        out["kernel_ms"] = {name: scale * value for name, value in ms.items()}
        out["fwd_split"] = _split(out["triton_fwd_s"], out["kernel_ms"], FORWARD_KERNELS)
        out["fwd_bwd_split"] = _split(out["triton_fwd_bwd_s"], out["kernel_ms"], out["kernel_ms"])
    if quick:
        return out
    if with_torch:
        out["torch_fwd_s"] = scale * _seconds(lambda: rule("torch"), 1, device)
        out["torch_fwd_bwd_s"] = scale * _seconds(_backward_of(lambda: rule("torch")), 1, device)
    convs = {
        "conv_triton": lambda: triton_path_conv(mixed, layer.conv1d, plan.deltanet.conv, layer.activation),
        "conv_torch": lambda: path_conv(mixed, layer.conv1d, plan.deltanet, layer.activation),
        "layer": lambda: tree_deltanet_forward(layer, hidden, plan.deltanet, "triton"),
    }
    for name, run in convs.items():
        out[f"{name}_fwd_bwd_s"] = scale * _seconds(_backward_of(under_autocast(run)), repeats, device)
    return out


def passed(checks: dict) -> tuple[bool, float]:
    """(every Triton and convolution relative L2 error below `PASS_REL_L2`, the worst of them)."""
    worst = max(
        e[0] for label, errors in checks.items() if not label.startswith("torch") for e in errors.values()
    )
    return worst < PASS_REL_L2, worst


def _print_times(label: str, times: dict) -> None:
    ms = {k.removesuffix("_s"): 1e3 * v for k, v in times.items() if k.endswith("_s")}
    line = f"  ms per layer per {ROW_TOKENS} tokens, {label}: triton delta rule"
    for key, name in (("fwd_split", "fwd"), ("fwd_bwd_split", "fwd+bwd")):
        if key in times:
            split = times[key]
            line += (f" {name} {split['ms']:.2f} (kernels {split['kernels_ms']:.2f}, other {split['other_ms']:.2f} = "
                     f"{100 * split['other_ms'] / split['ms']:.0f}%)")  # fmt: skip
        else:
            line += f" {name} {ms['triton_' + name.replace('+', '_')]:.2f}"
    if "torch_fwd_bwd" in ms:
        line += f"; torch rule fwd {ms['torch_fwd']:.1f}, fwd+bwd {ms['torch_fwd_bwd']:.1f}"
    if "layer_fwd_bwd" in ms:
        line += (f"; path conv fwd+bwd triton {ms['conv_triton_fwd_bwd']:.2f} / pytorch {ms['conv_torch_fwd_bwd']:.2f}; "
                 f"whole layer fwd+bwd {ms['layer_fwd_bwd']:.2f} (conv {100 * ms['conv_triton_fwd_bwd'] / ms['layer_fwd_bwd']:.0f}%, "
                 f"delta rule {100 * ms['triton_fwd_bwd'] / ms['layer_fwd_bwd']:.0f}%)")  # fmt: skip
    print(line)
    if "kernel_ms" in times:
        print(f"  triton kernels ({label}), ms in one fwd+bwd: "
              + ", ".join(f"{k} {v:.3f}" for k, v in times["kernel_ms"].items()))  # fmt: skip


def _print(ratio: float, rows: dict, plans: dict, checks: dict, times: dict) -> None:
    shapes = "; ".join(f"{kind} row of {row.num_tokens} tokens, {row.num_segments} segments, "
                       f"{len(plans[kind].deltanet.levels)} levels" for kind, row in rows.items())  # fmt: skip
    print(f"ratio {ratio}: {shapes}")
    for label, errors in checks.items():
        cells = "  ".join(f"{n} {l2:.1e}/{mx:.1e}/{rel:.1e}" for n, (l2, mx, rel) in errors.items())
        print(f"  parity {label:<11} (rel L2 / max abs / max rel): {cells}")
    ok, worst = passed(checks)
    print(f"  parity {'PASS' if ok else 'FAIL'}: worst triton rel L2 {worst:.1e} (limit {PASS_REL_L2:.0e})")
    for kind, row_times in times.items():
        _print_times(f"{kind} row", row_times)
    print(flush=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="1,3.4", help="packing ratios whose first tree row is measured")
    parser.add_argument("--prompts", type=int, default=2, help="GRPO groups the rows are planned from")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed calls per Triton measurement (torch: 1)"
    )
    parser.add_argument("--launch", default="default", choices=sorted(LAUNCHES), help="kernel launch preset")
    parser.add_argument("--quick", action="store_true", help="the bf16 Triton path only (parity and time)")
    parser.add_argument(
        "--with-torch", action="store_true", help="also time the PyTorch rule (~0.1 s a call)"
    )
    parser.add_argument("--json", default=None, help="write all measurements here")
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke test (tiny shape and rows; set TRITON_INTERPRET=1)"
    )
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    name, device = ("tiny-hybrid", "cpu") if args.tiny else (MODEL, "cuda")
    launch = apply_launch(args.launch)
    model = build_random_model(name, 2, device, torch.float32)  # one Gated DeltaNet layer, one attention
    enable_tree_attention(model)  # for the plan only: each measurement names its kernel
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"delta_rule_kernels on {device_name}, torch {torch.__version__}, launch {args.launch}: {launch}")
    variants = {k: v for k, v in VARIANTS.items() if not args.quick or k == "triton bf16"}
    results = []
    for ratio in (float(r) for r in args.ratios.split(",")):
        samples = grpo_samples(ratio, num_prompts=args.prompts, vocab=model.config.vocab_size, tiny=args.tiny)
        budget = 256 if args.tiny else ROW_TOKENS
        kinds = ("tree",) if args.quick else ("tree", "plain")
        rows = {kind: first_row(samples, budget, share_prefixes=kind == "tree") for kind in kinds}
        plans = {kind: build_tree_plan(row, model) for kind, row in rows.items()}
        tree, plan = rows["tree"], plans["tree"]
        checks = parity(plan.deltanet, layer_inputs(model.config, tree.num_tokens, device), variants)
        if not args.quick:
            checks["conv bf16"] = conv_parity(
                plan.deltanet, model.model.layers[0].linear_attn, tree.num_tokens
            )
        times = {kind: row_seconds(model, rows[kind], plans[kind], args.repeats, quick=args.quick,
                                   with_torch=args.with_torch) for kind in kinds}  # fmt: skip
        _print(ratio, rows, plans, checks, times)
        results.append(dict(ratio=ratio, tokens=tree.num_tokens, parity=checks, passed=passed(checks)[0],
                            seconds=times["tree"], plain_seconds=times.get("plain"),
                            plain_tokens=rows["plain"].num_tokens if "plain" in rows else None))  # fmt: skip
        if args.json:  # after every ratio: a run cut by its time limit keeps what it measured
            run = {"device": device_name, "launch": args.launch, "table": launch, "results": results}
            with open(args.json, "w") as f:
                json.dump(run, f, indent=1)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
