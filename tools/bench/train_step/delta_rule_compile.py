"""agrpo's Triton kernels compiled for a GPU target on a machine without one: do they build, and how big.

Run: `uv run python -m tools.bench.train_step.delta_rule_compile [--arch 90] [--precision tf32] [--launch w8]`.
Owns the ahead-of-time build (Triton's own `triton.compile` with an explicit `GPUTarget`, the way
`triton.tools.compile` does it) of every kernel of `_delta_rule_triton_forward` / `_backward` at the hybrid's
shapes (K = V = 128, chunk 64) under a launch preset of `delta_rule_kernels.LAUNCHES`, and of the path
convolution's kernels (`_path_conv_triton_kernels`, 4 taps), with the pointer dtypes they get under autocast
(bf16 activations and their gradients, fp32 state, weights and scratch, int32 tables), and prints per kernel
the compile seconds, shared memory, the tensor-core instructions in the PTX (wgmma on sm_90, mma.sync
otherwise) and ptxas' register and spill report. A CPU-only check that the kernels compile for Hopper with
this Triton before a GPU run; it says nothing about speed or values. Does not run anything.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from .delta_rule_kernels import LAUNCHES, apply_launch

INT_POINTERS = {
    "cu_ptr", "table_ptr", "chunk_cu_ptr", "parent_ptr", "level_ptr", "child_cu_ptr", "children_ptr", "pred_ptr",
    "fork_ptr", "fork_cu_ptr", "succ_ptr",
}  # fmt: skip
HALF_POINTERS = {
    "qk_norm_forward": {"q_ptr", "k_ptr", "v_ptr", "beta_ptr"}, "output_forward": {"o_ptr"},
    "du_local": {"do_ptr"}, "state_backward": {"do_ptr"}, "wy_backward": {"dv_ptr", "dbeta_ptr"},
    "dqk_backward": {"do_ptr"}, "qk_norm_backward": {"dq_ptr", "dk_ptr"},
    "path_conv_forward": {"x_ptr", "out_ptr"}, "path_conv_backward": {"x_ptr", "dout_ptr", "dx_ptr"},
    "path_conv_forks": {"x_ptr", "dout_ptr", "dx_ptr"},
}  # fmt: skip
"""Pointers that hold bf16 under autocast (the layer's activations, the output and the input gradients)."""
FLOAT_SCALARS = {"scale"}


def _kernels(precision: str) -> list[tuple[str, object, dict]]:
    """(launch table name, kernel, constexprs) of every kernel, as `run_forward` / `run_backward` and the path
    convolution's ops launch them."""
    from agrpo_attention import _delta_rule_triton_backward as bwd
    from agrpo_attention import _delta_rule_triton_forward as fwd
    from agrpo_attention import _path_conv_triton as conv
    from agrpo_attention import _path_conv_triton_kernels as conv_kernels

    bk, bv = fwd.tile_sizes(128, 128)
    base = dict(K=128, V=128, C=fwd.CHUNK, BK=bk, PRECISION=precision)
    state, gradient = dict(base, BV=min(bv, fwd.STATE_BLOCK)), dict(base, BV=min(bv, bwd.GRADIENT_BLOCK))
    norm = dict(REP=1, K=128, BT=fwd.TOKEN_BLOCK, BK=bk)
    taps = dict(K=4, HAS_BIAS=False, SILU=True)
    return [
        ("qk_norm_forward", fwd.qk_norm_forward_kernel, dict(norm, V=128, BV=128)),
        ("wy_forward", fwd.wy_forward_kernel, dict(base, BV=bv, INVERSE_PRECISION="tf32x3")),
        ("state_forward", fwd.state_forward_kernel, dict(state, HAS_INITIAL=False)),
        ("output_forward", fwd.output_forward_kernel, dict(base, BV=bv)),
        ("du_local", bwd.du_local_kernel, dict(base, BV=bv)),
        ("state_backward", bwd.state_backward_kernel, dict(state, HAS_DFINAL=False)),
        ("wy_backward", bwd.wy_backward_kernel, state),
        ("dqk_backward", bwd.dqk_backward_kernel, gradient),
        ("qk_norm_backward", bwd.qk_norm_backward_kernel, norm),
        ("path_conv_forward", conv_kernels.path_conv_forward_kernel,
         dict(taps, BT=conv.TOKEN_BLOCK, BC=conv.CHANNEL_BLOCK)),
        ("path_conv_backward", conv_kernels.path_conv_backward_kernel,
         dict(taps, KP=4, BT=conv.BACKWARD_TOKEN_BLOCK, BC=conv.CHANNEL_BLOCK, BLOCKS=conv.BACKWARD_BLOCKS)),
        ("path_conv_forks", conv_kernels.path_conv_forks_kernel,
         dict(taps, BE=conv.SUCCESSOR_BLOCK, BC=conv.CHANNEL_BLOCK)),
    ]  # fmt: skip


def _ptxas_report(ptx: str, arch: int) -> str:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        suffix = "a" if arch >= 90 else ""
        run = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}{suffix}", str(source), "-o",
                              str(Path(tmp) / "kernel.o")], capture_output=True, text=True, check=True)  # fmt: skip
    lines = [line.split("info    :")[-1].strip() for line in run.stderr.splitlines()]
    return "; ".join(line for line in lines if "registers" in line or "spill" in line)


def _argument_type(name: str, constexprs: dict, half: set[str]) -> str:
    if name in constexprs:
        return "constexpr"
    if not name.endswith("_ptr"):
        return "fp32" if name in FLOAT_SCALARS else "i32"
    return "*i32" if name in INT_POINTERS else "*bf16" if name in half else "*fp32"


def compile_kernel(kernel, constexprs: dict, arch: int, num_warps: int, num_stages: int, half=()) -> str:
    """One line: compile seconds, shared bytes, tensor-core instructions, ptxas' report; `half` names the
    bf16 pointers."""
    import triton
    from triton.backends.compiler import GPUTarget

    names = kernel.arg_names
    signature = {n: _argument_type(n, constexprs, set(half)) for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    target = GPUTarget("cuda", arch, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": num_warps, "num_stages": num_stages}
    )
    start = time.perf_counter()
    compiled = triton.compile(source, target=target, options=options.__dict__)
    seconds = time.perf_counter() - start
    ptx = compiled.asm["ptx"]
    cores = f"wgmma {ptx.count('wgmma.mma_async')}, mma.sync {ptx.count('mma.sync')}"
    return f"{seconds:5.1f} s  shared {compiled.metadata.shared:>6}  {cores}  | {_ptxas_report(ptx, arch)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    parser.add_argument("--precision", default="tf32", choices=["tf32", "tf32x3"], help="dot precision")
    parser.add_argument("--launch", default="default", choices=sorted(LAUNCHES), help="launch preset")
    parser.add_argument("--only", default=None, help="comma list of kernels (launch table names)")
    args = parser.parse_args()
    table = apply_launch(args.launch)
    print(f"sm_{args.arch}, precision {args.precision}, launch {args.launch}", flush=True)
    from agrpo_attention._path_conv_triton import NUM_STAGES, NUM_WARPS

    for name, kernel, constexprs in _kernels(args.precision):
        if args.only and name not in args.only.split(","):
            continue
        warps, stages = table.get(name, (NUM_WARPS, NUM_STAGES))
        line = compile_kernel(kernel, constexprs, args.arch, warps, stages, HALF_POINTERS.get(name, ()))
        print(f"  {name:<15} warps {warps} stages {stages}  {line}", flush=True)


if __name__ == "__main__":
    main()
