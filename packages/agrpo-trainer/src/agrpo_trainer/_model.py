"""The policy model and its tokenizer: loading, freezing non-text towers, LoRA, tree attention, the router loss.

Owns what `AsyncGRPOTrainer(model=...)` accepts (SPEC F-API): a hub id or local path, loaded as
`AutoModelForImageTextToText` when the config is vision-language (its vision/audio towers and projector
frozen: text-only training, no optimizer state, skipped by weight sync) and `AutoModelForCausalLM`
otherwise, in `args.dtype` unless `model_init_kwargs["dtype"]` says otherwise; or a `PreTrainedModel`,
used as given. Also the MoE router-loss rule (SPEC F-LOSS): `router_aux_loss_coef=None` takes the model
config's value, and setting it on a model without a router is an error; and routing replay (issue 33):
`enable_routes` patches a MoE policy (agrpo-attention's `enable_routing_replay`), refusing `routing_replay`
on a dense model. Does not know training or sync.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)

from agrpo_sync import WeightSyncConfig

from ._exceptions import ModelSetupError

logger = logging.getLogger("agrpo_trainer")

_VISION_CONFIG_KEYS = ("vision_config", "visual_config", "vision_tower_config", "audio_config")
_ROUTER_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_vision_language(config: Any) -> bool:
    """A config with a vision/audio sub-config is loaded with `AutoModelForImageTextToText`."""
    return any(getattr(config, key, None) is not None for key in _VISION_CONFIG_KEYS)


def _init_kwargs(args: Any) -> dict[str, Any]:
    kwargs = dict(args.model_init_kwargs or {}) if isinstance(args.model_init_kwargs, dict) else {}
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", args.dtype))
    kwargs["dtype"] = dtype if dtype == "auto" or not isinstance(dtype, str) else getattr(torch, dtype)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def load_model(model: str | os.PathLike | PreTrainedModel, args: Any) -> PreTrainedModel:
    """The policy as `model` names it; non-text towers of vision-language models come back frozen."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, PreTrainedModel):
        if args.model_init_kwargs:
            logger.warning("model_init_kwargs is ignored: `model` is already a PreTrainedModel")
        loaded = model
    elif isinstance(model, str):
        kwargs = _init_kwargs(args)
        config = AutoConfig.from_pretrained(model, trust_remote_code=kwargs["trust_remote_code"])
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        loaded = auto.from_pretrained(model, **kwargs)
    else:
        raise TypeError(
            f"model is a {type(model).__name__}; pass a hub id, a local path or a transformers PreTrainedModel"
        )
    frozen = freeze_non_text_towers(loaded)
    if frozen:
        logger.info("vision-language model: froze %s (text-only training; not synced)", ", ".join(frozen))
    return loaded


def freeze_non_text_towers(model: torch.nn.Module) -> list[str]:
    """Set `requires_grad=False` on every module named like a vision/audio tower or projector."""
    names = WeightSyncConfig.__dataclass_fields__["non_text_modules"].default
    frozen = []
    for name, module in model.named_modules():
        if name.split(".")[-1] in names and any(p.requires_grad for p in module.parameters()):
            module.requires_grad_(False)
            frozen.append(name)
    return frozen


def load_processing_class(model: str | os.PathLike | PreTrainedModel, args: Any) -> Any:
    """The tokenizer saved with the model; its `pad_token` falls back to `eos_token`."""
    source = (
        os.fspath(model) if isinstance(model, str | os.PathLike) else getattr(model, "name_or_path", None)
    )
    if not source:
        raise ValueError("the model has no name_or_path to load a tokenizer from; pass processing_class")
    revision = (
        (args.model_init_kwargs or {}).get("revision") if isinstance(args.model_init_kwargs, dict) else None
    )
    tokenizer = AutoTokenizer.from_pretrained(
        source, trust_remote_code=args.trust_remote_code, revision=revision
    )
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def with_lora(model: PreTrainedModel, peft_config: Any, args: Any) -> Any:
    """`model` wrapped in a PEFT adapter (only the adapter trains), or `model` when `peft_config` is None."""
    if peft_config is None:
        return model
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config)
    if (
        args.gradient_checkpointing
    ):  # checkpointed blocks need an input that requires grad (frozen embeddings)
        wrapped.enable_input_require_grads()
    if args.save_strategy == "no":
        logger.warning("save_strategy='no' with LoRA: the trained adapter is kept nowhere when training ends")
    return wrapped


def enable_tree(policy: Any, backend: str) -> str:
    """Switch the policy (a PEFT wrapper's base model) to tree attention on the device it is on now; called
    again once the Trainer placed it (the backend and its device are chosen there)."""
    from agrpo_attention import enable_tree_attention

    return enable_tree_attention(
        policy.get_base_model() if hasattr(policy, "get_base_model") else policy, backend
    )


def prepare_policy(model: Any, args: Any, peft_config: Any, processing_class: Any) -> tuple[Any, Any, str]:
    """(policy, tokenizer, attention backend): loaded, LoRA-wrapped if asked, switched to tree attention."""
    tokenizer = processing_class if processing_class is not None else load_processing_class(model, args)
    policy = with_lora(load_model(model, args), peft_config, args)
    on_cpu = (
        next(policy.parameters()).device.type == "cpu"
    )  # not placed yet: check the model on the reference
    backend = enable_tree(policy, "reference" if on_cpu else args.attention_backend)
    enable_routes(policy, args.routing_replay)
    return policy, tokenizer, backend


def enable_routes(policy: Any, replay: bool) -> None:
    """Patch a MoE policy's layers so rows that carry routes measure route agreement and, with `replay`
    (`routing_replay`), train on the sampler's experts. `replay` on a dense model, or on a MoE block replay
    does not support, is a ModelSetupError; without `replay` such a model just goes unmeasured."""
    from agrpo_attention import UnsupportedModelError, enable_routing_replay

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    if not replay and not has_router(base):
        return
    try:
        settings = enable_routing_replay(base, replay=replay)
    except UnsupportedModelError as error:
        if replay:
            raise ModelSetupError(f"routing_replay=True: {error}") from error
        logger.info("MoE route agreement is not measured: %s", error)
        return
    logger.info("MoE routing replay %s on %d layers", "on" if replay else "off (agreement only)",
                len(settings.moe_layers))  # fmt: skip


def has_router(model: torch.nn.Module) -> bool:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return any(getattr(config, key, None) for key in _ROUTER_CONFIG_KEYS)


def router_aux_loss_coef(model: torch.nn.Module, requested: float | None) -> float:
    """The router loss weight in force: `requested`, or the model config's; errors on a model without router."""
    if not has_router(model):
        if requested:
            raise ModelSetupError(
                f"router_aux_loss_coef={requested} but {type(model).__name__} has no MoE router; "
                "leave router_aux_loss_coef=None for dense models"
            )
        return 0.0
    if requested is not None:
        return float(requested)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def check_server_routes(args: Any, policy: Any, rank: int, world: int) -> None:
    """On rank 0, with `return_routed_experts`, probe every server for routes that fit the policy (`ServerConfigError`
    naming `--enable-return-routed-experts` when it returns none); nothing otherwise."""
    if rank == 0 and args.return_routed_experts:
        from agrpo_rollout import check_routed_experts

        check_routed_experts(args.rollout_config(num_processes=world, policy=policy))
