"""Model FLOPs of a packed row, and the peak FLOP/s of the training device: the two halves of `perf/mfu_*`.

Owns `ModelFlops` (the count for one packed forward+backward, from the model's shapes) and `peak_flops`
(a table of dense tensor-core peaks by device name and training precision). MFU is reported only when
the peak is known (the reference): a CPU, or a GPU missing from the table, gives None and the trainer
omits `perf/mfu_*`; `AsyncGRPOConfig.device_peak_flops` supplies a peak for any other device.

The count, per row of N forwarded tokens and M loss terms (the trainer's FLOPs, recomputation excluded):

    6 * P * N            matmuls of the decoder body (P: parameters outside the embeddings, the LM head and
                         frozen vision/audio towers, which a text-only forward never runs; a mixture of
                         experts counts its experts' parameters times top-k / experts, the share a token uses)
  + 6 * V * d * M        the LM head, which agrpo-attention applies only at the M positions that predict a
                         loss term (V * d: the head's parameters)
  + 12 * h * sum_l A_l   softmax attention: QK^T and AV, 2 FLOPs per multiply-add, x3 for the backward,
                         over A_l attended (query, key) pairs of layer l; in a prefix tree a token at depth p
                         attends to its p + 1 ancestors, so A = sum(position_ids + 1), and in a layer with a
                         sliding window W to min(p + 1, W) of them (Gemma 2/3, gpt-oss, Mistral). l runs over
                         the softmax-attention layers (the linear-attention layers of a hybrid count through P
                         only), h: heads x head_dim.

Packing lowers N and A for the same samples, so MFU falls when packing improves (the reference says so:
judge throughput by trained tokens per second). Does not know timing or logging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agrpo_packing import PackedRow

# Dense (no sparsity) peak FLOP/s per device: (bf16/fp16, tf32, fp32). None: not listed. Matched in order on
# the device name torch reports (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200", "AMD Instinct MI300X").
PEAK_FLOPS: tuple[tuple[str, tuple[float | None, float | None, float | None]], ...] = (
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100 NVL", (835e12, 418e12, 60e12)),
    ("H200 NVL", (835e12, 418e12, 60e12)),
    ("H100", (989e12, 495e12, 67e12)),
    ("H800", (989e12, 495e12, 67e12)),
    ("H200", (989e12, 495e12, 67e12)),
    ("A100", (312e12, 156e12, 19.5e12)),
    ("A800", (312e12, 156e12, 19.5e12)),
    ("B200", (2250e12, 1100e12, None)),
    ("MI300X", (1307e12, 654e12, None)),
    ("MI325X", (1307e12, 654e12, None)),
    ("MI250X", (383e12, None, 95.7e12)),
)


def precision_of(model: torch.nn.Module, *, mixed_precision: bool) -> str:
    """The precision the matmuls run in: bf16/fp16 autocast, else the weights' dtype (fp32 as tf32 when torch
    allows it)."""
    if mixed_precision:
        return "bf16"
    dtype = next(model.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The table's peak for `device` in `precision` ("bf16", "tf32", "fp32"); None on a CPU or an unlisted
    device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    column = {"bf16": 0, "tf32": 1, "fp32": 2}[precision]
    for pattern, peaks in PEAK_FLOPS:
        if pattern in name:
            return peaks[column]
    return None


def _expert_share(config: Any) -> float:
    """top-k / experts of a mixture-of-experts config (1.0 for a dense one)."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((getattr(config, k) for k in keys if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return float(top_k) / float(experts) if experts and top_k else 1.0


def _tower_prefixes(model: torch.nn.Module, tower_names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(
        f"{name}." for name, _ in model.named_modules() if name and name.split(".")[-1] in tower_names
    )


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The shape constants of the count above; `row_flops` applies them to one packed row."""

    body_params: int
    head_params: int
    attention_windows: tuple[int | None, ...]
    """The sliding window of each softmax-attention layer, None for a layer that sees its whole path."""
    attention_width: int
    """heads x head_dim of the queries."""

    @classmethod
    def of(cls, model: torch.nn.Module, tower_names: tuple[str, ...] = ()) -> ModelFlops:
        model = getattr(model, "module", model)  # DDP
        head = model.get_output_embeddings()
        head_weight = head.weight if head is not None else None
        skip = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
        skip |= {id(head_weight)} if head_weight is not None else set()
        towers = _tower_prefixes(model, tower_names)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        share = _expert_share(config)
        body = sum(
            p.numel() * (share if ".experts." in name else 1.0)
            for name, p in model.named_parameters()
            if id(p) not in skip and not name.startswith(towers)
        )
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(
            body_params=int(body),
            head_params=int(head_weight.numel()) if head_weight is not None else 0,
            attention_windows=_attention_windows(config),
            attention_width=heads * head_dim,
        )

    def row_flops(self, row: PackedRow) -> float:
        """FLOPs of one forward+backward of `row`."""
        tokens = row.num_tokens
        seen = row.position_ids.to(torch.int64) + 1  # keys each token's query attends without a window
        attended = {w: float((seen if w is None else seen.clamp(max=w)).sum()) for w in set(self.attention_windows)}
        return (
            6.0 * self.body_params * tokens
            + 6.0 * self.head_params * row.num_loss_terms
            + 12.0 * self.attention_width * sum(attended[w] for w in self.attention_windows)
        )


def _attention_windows(config) -> tuple[int | None, ...]:
    """The window of each softmax-attention layer: `sliding_window` on "sliding_attention" layers; a config
    without `layer_types` (Mistral) windows every layer when it sets `sliding_window`."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    return tuple(
        window if kind == "sliding_attention" else None
        for kind in layer_types
        if "attention" in kind and "linear" not in kind
    )


def flop_counting(policy: torch.nn.Module, args: Any) -> tuple[ModelFlops, float | None]:
    """The policy's count and the peak its MFU divides by (`device_peak_flops`, else the table's) for an
    `AsyncGRPOConfig`'s device and precision."""
    flops = ModelFlops.of(policy, args.sync_config().non_text_modules)
    precision = precision_of(policy, mixed_precision=bool(args.bf16 or args.fp16))
    return flops, args.device_peak_flops or peak_flops(args.device, precision)
