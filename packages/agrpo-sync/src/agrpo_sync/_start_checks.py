"""Start-up of a weight sync: which backend serves this model on these servers, and what to warn about.

Owns the start-up sequence of the sending rank (`start_sender`: one `ServerControl` per server, their
`ServerInfo`, the backend, the manifest, the backend's setup), choosing the backend (full weights over `nccl` or `disk`; for a PEFT model, adapter-only when the
server can serve it and `lora_sync` allows, merged weights otherwise) and the start-up checks of a
full-weight sync: the server's transfer flag (an error naming the flag), a dtype mismatch (a warning)
and a tied embedding on a CPU server (a warning: vLLM 0.32's CPU backend prepacks the tied `lm_head`
at load and its in-place reload never re-processes it, so embedding updates reach the input side only;
GPU servers have no such copy), and routed MoE experts on a CPU server (`kept_on_cpu_server`: vLLM 0.32's CPU
backend packs them into its grouped-GEMM layout at load, and its in-place reload copies plain weights over the
packed ones without packing them, so the server computes garbage after any reload that includes them, even of
unchanged values; gpt-oss's routed experts and attention sinks, which its loader copies into the parameters
without a weight loader, keep their start-up values through the reload; frozen ones are left out of every sync,
trainable ones are refused naming the fix, and so is LoRA: merged weights carry every expert, and adapters crash
the CPU engine's MoE layers). With
several servers every one is checked, and they must all take the
same backend (under `lora_sync="auto"`, one that cannot serve adapters makes all of them take merged
weights). Does not know how anything is sent.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ._config import WeightSyncConfig
from ._exceptions import SyncSetupError
from ._lora_limits import adapter_problems, check_adapter_server, lora_config_of
from ._lora_weights import has_lora
from ._manifest import Manifest
from ._param_stream import ParamStream
from ._registry import BACKENDS
from ._server_control import ServerControl, ServerInfo
from ._sync_journal import JOURNAL_NAME, settle_interrupted_sync

logger = logging.getLogger("agrpo_sync")


def choose_backend(config: WeightSyncConfig, model: torch.nn.Module, infos: list[ServerInfo]) -> str:
    """`lora` for adapter-only sync of a PEFT model when allowed and every server can serve it, else
    `config.backend`."""
    if not has_lora(model) or config.lora_sync == "merged":
        return config.backend
    lora_config = lora_config_of(model)
    if config.lora_sync == "adapter":
        for info in infos:
            check_adapter_server(info, lora_config, config.max_staleness)
        return "lora"
    problems = [p for info in infos for p in adapter_problems(info, lora_config, config.max_staleness)]
    if problems:
        logger.warning(
            "LoRA: pushing merged weights over %s; adapter sync is off: %s",
            config.backend,
            "; ".join(dict.fromkeys(problems)),
        )
        return config.backend
    return "lora"


def has_tied_embedding(model: torch.nn.Module) -> bool:
    """True when the model's output head shares its weight with the input embedding."""
    get_input, get_output = (
        getattr(model, n, None) for n in ("get_input_embeddings", "get_output_embeddings")
    )
    if get_input is None or get_output is None:
        return False
    embedding, head = get_input(), get_output()
    weight = getattr(embedding, "weight", None)
    return weight is not None and weight is getattr(head, "weight", None)


def check_full_sync(
    config: WeightSyncConfig, info: ServerInfo, model: torch.nn.Module, stream: ParamStream
) -> None:
    """Start-up checks of a full-weight sync: the server's transfer flag; warnings for a dtype mismatch and
    for a tied embedding on a CPU server."""
    if config.backend == "nccl" and info.weight_transfer_backend != "nccl":
        raise SyncSetupError(
            f"the server's weight transfer backend is {info.weight_transfer_backend!r}; restart it with "
            """VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{"backend":"nccl"}', or set backend="disk\""""
        )
    sent = sorted({m.dtype_name for m in stream.metadata()})
    if info.dtype and sent != [info.dtype]:
        logger.warning(
            "the server runs %s and the trainer sends %s; set transfer_dtype to match", info.dtype, sent
        )
    if info.device == "cpu" and has_tied_embedding(model):
        logger.warning(
            "the model ties its output head to its input embedding and the server runs on CPU: vLLM %s's CPU "
            "backend prepacks the tied lm_head at load and never refreshes it on reload, so updates of the "
            "embedding reach the server's input side only and its output head keeps the start-up weights. "
            "Untie them (tie_word_embeddings=False) to train the embedding against a CPU server, or use a GPU "
            "server",
            info.version,
        )


def routed_expert_names(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """(name, requires_grad) of every parameter of a routed expert bank: the `experts` of a module that also has
    a router, `gate` in most of transformers' MoE blocks and `router` in gpt-oss's (a shared expert is a plain
    MLP and is not listed)."""
    banks = [
        f"{n}.experts." if n else "experts."
        for n, m in model.named_modules()
        if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))
    ]
    return [(n, p.requires_grad) for n, p in model.named_parameters() if any(b in n for b in banks)]


def attention_sink_names(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """(name, requires_grad) of every learned attention sink (gpt-oss's `self_attn.sinks`)."""
    return [(n, p.requires_grad) for n, p in model.named_parameters() if n.endswith("self_attn.sinks")]


def kept_on_cpu_server(model: torch.nn.Module, infos: list[ServerInfo], view: str) -> frozenset[str]:
    """Names a full-weight sync leaves out because a CPU server must keep its own copy: the routed experts and
    attention sinks (see the module docstring). Empty without a CPU server or without either. Raises
    SyncSetupError when they would have to be sent (trainable, or merged LoRA weights) and for adapter sync of a
    model with routed experts, which such a server cannot serve."""
    cpu = [info for info in infos if info.device == "cpu"]
    experts, sinks = routed_expert_names(model), attention_sink_names(model)
    if not cpu or not (experts or sinks):
        return frozenset()
    if view == "adapter" and experts:
        raise SyncSetupError(
            f"LoRA adapters on a CPU server (vLLM {cpu[0].version}) for a model with routed MoE experts: with "
            "--enable-lora its MoE layers run a Triton kernel the CPU build cannot run, and the engine dies at the "
            "first adapter request (measured on Qwen3-Next, an adapter on attention and Gated DeltaNet only). Train "
            "without peft_config (routed experts frozen), or serve from a GPU vLLM server"
        )
    if view == "adapter":
        return frozenset()  # adapters never carry the base model's sinks
    trained = [n for n, requires_grad in experts + sinks if requires_grad]
    if trained or has_lora(model):
        kinds = [(k, m) for k, m, names in (("routed MoE experts", "mlp.experts", experts),
                                             ("attention sinks", "self_attn.sinks", sinks)) if names]  # fmt: skip
        raise SyncSetupError(
            f"the server runs on CPU (vLLM {cpu[0].version}) and the model's {' and '.join(k for k, _ in kinds)} "
            f"would be sent ({trained[0] if trained else 'merged LoRA weights'}, ...): its in-place reload cannot "
            "take them (routed experts that its CPU backend packs at start-up are overwritten without packing, "
            "after which the server computes garbage; gpt-oss's experts and sinks, which its loader copies without "
            "a weight loader, keep their start-up values). Freeze them (e.g. `for layer in model.model.layers: "
            f"{'; '.join(f'layer.{m}.requires_grad_(False)' for _, m in kinds)}`; routers and shared experts still "
            "train) and train without LoRA, or serve from a GPU vLLM server"
        )
    return frozenset(n for n, _ in experts + sinks)


def start_sender(
    sync_cls: type, config: WeightSyncConfig, model: torch.nn.Module, transport, world_size: int
):
    """The sending rank's `WeightSync`: every server checked, the backend chosen and set up (e.g. the NCCL
    rendezvous with each server), the manifest of what the servers hold. First, servers that a killed trainer's
    sync left paused in this output directory are resumed where their weights are one version."""
    settle_interrupted_sync(Path(config.output_dir).resolve() / JOURNAL_NAME)
    controls = [
        ServerControl(url, timeout_s=config.http_timeout_s, transfer_timeout_s=config.transfer_timeout_s)
        for url in config.server_urls
    ]
    infos = [control.server_info() for control in controls]
    name = choose_backend(config, model, infos)
    backend = BACKENDS[name].from_config(config, controls, transport)
    sync = sync_cls(
        config=config, backend_name=name, backend=backend, controls=controls, rank=0, world_size=world_size
    )
    sync.kept = kept_on_cpu_server(model, infos, backend.view)
    stream = sync.param_stream(model)
    if backend.view == "full":
        for info in infos:
            check_full_sync(config, info, model, stream)
        sync.manifest = Manifest.from_weight_info(controls[0].weight_info()) or Manifest.from_checkpoint(
            infos[0].model_root
        )
    backend.setup(model, stream, infos)
    logger.info(
        "weight sync: %s backend, %d tensors, %.3f GB per sync, %d server(s)",
        name,
        len(stream.entries),
        stream.nbytes / 1e9,
        len(controls),
    )
    return sync
