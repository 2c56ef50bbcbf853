"""GPU parity of tree attention and tree Gated DeltaNet on realistic shapes, with bf16 tolerances stated.

Run: `python -m tools.bench.tree_attention.parity` on a CUDA machine (`--cpu-dry-run` tests this
script on CPU with reference pieces). Checks, printing every number:
1. attention alone on a GRPO row at ratio ~3.4 (~12k tokens), Qwen3-1.7B and hybrid head shapes, bf16
   inputs: cascade, varlen and flex outputs and q/k/v gradients against the fp32-math reference backend.
   Tolerance: relative L2 error <= 1e-2 (bf16 has 8 mantissa bits: ~4e-3 per rounding);
2. a small dense model in bf16: packed log-probs (each backend) and stock per-sample bf16 log-probs,
   each against the fp32 per-sample truth; tree error must be <= 2x the stock bf16 error + 1e-3;
3. a small hybrid in fp32: the fla-core tree path against the pure-PyTorch tree path (log-probs and
   every parameter gradient), and against per-sample fp32 truth.
Exits non-zero if a check fails. Does not time anything (see `__main__.py`).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass

import torch

from agrpo_attention import build_tree_plan, enable_tree_attention, token_logprobs

from .model_shapes import SHAPES, build_random_model
from .workload import build_workload

FAILURES: list[str] = []


@dataclass(kw_only=True, slots=True, frozen=True)
class Setup:
    """Where the checks run; `--cpu-dry-run` swaps in CPU-runnable pieces to test this script itself."""

    device: str = "cuda"
    """Device of every tensor and model."""
    backends: tuple[str, ...] = ("cascade", "varlen", "flex")
    """Attention backends checked against the reference."""
    kernels: tuple[str, str] = ("torch", "fla")
    """Gated DeltaNet kernels compared (the first is the baseline)."""
    scale: float = 1.0
    """Shrinks the attention rows (prompt and completion lengths)."""
    low_precision: torch.dtype = torch.bfloat16
    """Precision of the parity runs that have a low-precision side."""


CPU_DRY_RUN = Setup(device="cpu", backends=("reference",), kernels=("torch", "torch"), scale=1 / 16)


def _check(label: str, value: float, limit: float) -> None:
    ok = value <= limit
    print(f"  {'ok  ' if ok else 'FAIL'} {label}: {value:.3e} (limit {limit:.1e})", flush=True)
    if not ok:
        FAILURES.append(label)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def attention_parity(setup: Setup, shape_name: str) -> None:
    shape, device = SHAPES[shape_name], setup.device
    row = build_workload(3.4, int(16384 * setup.scale), shape["vocab"], scale=setup.scale).tree_rows[0]
    print(
        f"attention parity, {shape_name} heads, row of {row.num_tokens} tokens, ratio {row.packing_ratio:.2f}"
    )
    gen = torch.Generator(device=device).manual_seed(0)
    n, d, dtype = row.num_tokens, shape["head_dim"], setup.low_precision
    make = lambda h: torch.randn(1, h, n, d, device=device, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v = make(shape["heads"]), make(shape["kv_heads"]), make(shape["kv_heads"])
    grad = torch.randn(1, n, shape["heads"], d, device=device, dtype=dtype, generator=gen)

    def run(backend):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = build_tree_plan(row, backend=backend, device=device).attend(*inputs)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in inputs]

    want = run("reference")
    for backend in setup.backends:
        try:
            got = run(backend)
        except RuntimeError as error:  # a kernel failing: a failed check, the other backends still run
            print(f"  FAIL {shape_name} {backend} raised: {str(error)[:600]}", flush=True)
            FAILURES.append(f"{shape_name} {backend} raised")
            continue
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            _check(f"{shape_name} {backend} {name} rel L2 vs fp32 reference", _relative(a, b), 1e-2)


def _alone_logprobs(model, row) -> torch.Tensor:
    from agrpo_packing import reference_logprobs

    device = next(model.parameters()).device

    def sequence(ids):
        logits = model(input_ids=ids.to(device)[None]).logits[0, :-1].float()
        return logits.log_softmax(-1).gather(1, ids.to(device)[1:, None])[:, 0]

    with torch.no_grad():
        return reference_logprobs(row, sequence).to(device)


def dense_model_parity(setup: Setup) -> None:
    print(
        f"dense model parity (small-dense shape, 2 layers), {setup.low_precision} tree vs fp32 per-sample truth"
    )
    row = build_workload(3.4, 4096, 512, scale=0.25).tree_rows[0]
    model32 = build_random_model("small-dense", 2, setup.device, torch.float32).eval()
    truth = _alone_logprobs(model32, row)
    stock16 = copy.deepcopy(model32).to(setup.low_precision)
    stock_error = float((_alone_logprobs(stock16, row) - truth).abs().max())
    print(f"  stock per-sample low-precision max |logprob error|: {stock_error:.3e}")
    for backend in setup.backends:
        model = copy.deepcopy(stock16)
        enable_tree_attention(model, backend)
        try:
            with torch.no_grad():
                error = float((token_logprobs(model, row).float() - truth).abs().max())
        except RuntimeError as error:  # a kernel failing: a failed check, the other backends still run
            print(f"  FAIL dense {backend} raised: {str(error)[:600]}", flush=True)
            FAILURES.append(f"dense {backend} raised")
            continue
        _check(f"dense {backend} tree low-precision max |logprob error|", error, 2 * stock_error + 1e-3)


def _gradients(model, row) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    logprobs = token_logprobs(model, row)
    (logprobs * row.advantages.to(logprobs.device)).sum().backward()
    return logprobs.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def hybrid_fla_parity(setup: Setup) -> None:
    print(
        f"hybrid parity (small-hybrid shape, 4 layers, fp32): {setup.kernels[1]} tree path vs {setup.kernels[0]}"
    )
    row = build_workload(3.4, 4096, 512, scale=0.25).tree_rows[0]
    base = build_random_model("small-hybrid", 4, setup.device, torch.float32)
    truth = _alone_logprobs(copy.deepcopy(base).eval(), row)
    results = {}
    for kernel in setup.kernels:
        model = copy.deepcopy(base)
        enable_tree_attention(model, setup.backends[0], deltanet_kernel=kernel)
        results[kernel] = _gradients(model, row)
        _check(
            f"hybrid {kernel} tree max |logprob - per-sample|",
            float((results[kernel][0] - truth).abs().max()),
            1e-4,
        )
    g_t, g_f = results[setup.kernels[0]][1], results[setup.kernels[1]][1]
    worst = max(g_t, key=lambda n: _relative(g_f[n], g_t[n]))
    _check(f"hybrid fla vs torch worst gradient rel L2 ({worst})", _relative(g_f[worst], g_t[worst]), 1e-2)
    others = [n for n in g_t if not any(t in n for t in ("A_log", "dt_bias", "in_proj_a"))]
    worst = max(others, key=lambda n: _relative(g_f[n], g_t[n]))
    _check(
        f"hybrid fla vs torch worst non-gate gradient rel L2 ({worst})",
        _relative(g_f[worst], g_t[worst]),
        1e-3,
    )


def flex_probe() -> None:
    """Time FlexAttention's compile and run on a 4k-token tree row, printing as it goes."""
    import time

    row = build_workload(3.4, 4096, 512, scale=0.25).tree_rows[0]
    start = time.perf_counter()
    plan = build_tree_plan(row, backend="flex", device="cuda")
    torch.cuda.synchronize()
    print(f"  flex probe: block mask built in {time.perf_counter() - start:.1f} s", flush=True)
    q, k, v = (torch.randn(1, 4, row.num_tokens, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    from torch.nn.attention.flex_attention import flex_attention

    static = torch.compile(flex_attention)  # default: static shapes first
    for attempt in range(2):
        start = time.perf_counter()
        static(q, k, v, block_mask=plan.attention_state).sum().backward()
        torch.cuda.synchronize()
        print(
            f"  flex probe: static compile, fwd+bwd {attempt} took {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    for attempt in range(2):
        start = time.perf_counter()
        plan.attend(q, k, v).sum().backward()
        torch.cuda.synchronize()
        print(
            f"  flex probe: dynamic compile, fwd+bwd {attempt} took {time.perf_counter() - start:.1f} s",
            flush=True,
        )


def _setup() -> tuple[Setup, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="GPU parity of tree attention and tree Gated DeltaNet")
    parser.add_argument("--cpu-dry-run", action="store_true", help="test this script on CPU")
    parser.add_argument("--flex-probe", action="store_true", help="only time FlexAttention's compile")
    parser.add_argument("--backends", default="cascade,varlen,flex", help="attention backends to check")
    parser.add_argument("--shapes", default="qwen3-1.7b,qwen3.5-hybrid-2b", help="head shapes to check")
    parser.add_argument("--no-hybrid", action="store_true", help="skip the fla-core hybrid check")
    args = parser.parse_args()
    if args.cpu_dry_run:
        return CPU_DRY_RUN, args
    return Setup(backends=tuple(args.backends.split(","))), args


def main() -> None:
    setup, args = _setup()
    if args.flex_probe:
        flex_probe()
        return
    where = torch.cuda.get_device_name() if setup.device == "cuda" else "CPU dry run"
    print(f"{where}, torch {torch.__version__}", flush=True)
    for shape_name in args.shapes.split(","):
        attention_parity(setup, shape_name)
    dense_model_parity(setup)
    if not args.no_hybrid:
        hybrid_fla_parity(setup)
    print("parity:", "FAILED " + ", ".join(FAILURES) if FAILURES else "all checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
