"""The gated delta rule through `fla-core`'s Triton kernels (flash-linear-attention), for CUDA.

Owns the adapter from the varlen-with-initial-states signature of `_delta_rule_torch` to
`fla.ops.gated_delta_rule.chunk_gated_delta_rule` (fla-core >= 0.6: grouped value heads natively,
per-sequence initial and final states, q/k L2 norm in the kernel, gradients into the initial state).
Does not know trees; imports fla only when called.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def fla_unavailable_reason(device: torch.device) -> str | None:
    """None if fla-core's kernels can run on `device`, else why not. fla-core 0.6 refuses (raises in the
    backward) Gated DeltaNet on Hopper with 3.4 <= Triton < 3.7.1 unless tilelang is installed (Triton
    miscompiles a gated backward kernel there, fla issue #640): seen on the H200 machine, Triton 3.6."""
    if device.type != "cuda":
        return f"fla-core's Triton kernels need a GPU, the model is on {device}"
    if importlib.util.find_spec("fla") is None:
        return "fla-core is not installed: pip install fla-core"
    triton = _version_tuple(importlib.metadata.version("triton"))
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper and (3, 4) <= triton < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
        return (
            f"fla-core's gated backward is wrong on Hopper with Triton {'.'.join(map(str, triton))} (fla issue "
            "#640): upgrade Triton to >= 3.7.1 or pip install tilelang; deltanet_kernel='torch' works meanwhile"
        )
    return None


def fla_varlen_gated_delta_rule(q, k, v, g, beta, *, cu_seqlens, cu_seqlens_host, initial_state):
    """Same contract as `_delta_rule_torch.varlen_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.to(torch.int64),
        cu_seqlens_cpu=torch.tensor(cu_seqlens_host, dtype=torch.int64),
    )
    return out, final
