"""What a vLLM server must allow to serve a LoRA adapter version window, and the flags that fix it.

Owns the adapter's rank (`r` and any `rank_pattern`), the server limits it is checked against
(`--enable-lora`, `--max-lora-rank` among the values vLLM accepts, `--max-loras >= max_staleness + 2`,
runtime adapter updating, no data parallelism), and the exact restart command that names the flags.
Does not know how adapters are written or loaded (`_lora_backend.py`).
"""

from __future__ import annotations

import torch

from ._exceptions import SyncSetupError
from ._server_control import ServerInfo

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's `--max-lora-rank` accepts (0.32 and 0.33)."""


def lora_config_of(model: torch.nn.Module):
    """The active adapter's `LoraConfig` (from a PEFT model's `peft_config`)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        raise SyncSetupError(
            "adapter sync needs a PEFT model (peft.get_peft_model); this model has no peft_config"
        )
    active = getattr(model, "active_adapter", None) or next(iter(configs))
    return configs[active if isinstance(active, str) else active[0]]


def adapter_rank(config) -> int:
    return max([int(config.r), *(int(r) for r in (getattr(config, "rank_pattern", None) or {}).values())])


def adapter_problems(info: ServerInfo, config, max_staleness: int) -> list[str]:
    """Why the server cannot serve this adapter with `max_staleness + 1` live versions (empty: it can)."""
    problems = []
    if getattr(config, "use_dora", False):
        problems.append("the adapter uses DoRA, which vLLM does not serve")
    if getattr(config, "modules_to_save", None):
        problems.append(
            f"the adapter has modules_to_save={config.modules_to_save}, which vLLM does not serve"
        )
    if not info.lora_enabled:
        problems.append("the server runs without --enable-lora")
    else:
        if info.max_lora_rank < adapter_rank(config):
            problems.append(
                f"--max-lora-rank is {info.max_lora_rank}, below the adapter's rank {adapter_rank(config)}"
            )
        if info.max_loras < max_staleness + 2:
            problems.append(
                f"--max-loras is {info.max_loras}, below max_staleness + 2 = {max_staleness + 2} "
                f"({max_staleness + 1} live versions plus the next one, loaded before the oldest is unloaded)"
            )
    if not info.runtime_lora_updating:
        problems.append(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING is not set, so /v1/load_lora_adapter does not exist"
        )
    if info.data_parallel_size > 1:
        problems.append(
            f"the server is data-parallel (DP={info.data_parallel_size}); adapter loads reach one replica"
        )
    return problems


def restart_command(config, max_staleness: int) -> str:
    """The server command line that serves this adapter with the window `max_staleness` needs."""
    rank = adapter_rank(config)
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise SyncSetupError(
            f"adapter rank {rank} > 512, the largest vLLM serves; lower r or use lora_sync='merged'"
        )
    return (
        "VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve <model> "
        f"--enable-lora --max-lora-rank {fitting[0]} --max-loras {max_staleness + 2}"
    )


def check_adapter_server(info: ServerInfo, config, max_staleness: int) -> None:
    """Raise `SyncSetupError` listing every problem and the exact flags to restart the server with."""
    problems = adapter_problems(info, config, max_staleness)
    if problems:
        raise SyncSetupError(
            "the server cannot take adapter-only sync: "
            + "; ".join(problems)
            + f". Restart it as: {restart_command(config, max_staleness)} (or set lora_sync='merged')"
        )
