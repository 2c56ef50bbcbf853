"""`ServerInfo`: what a vLLM server can do, read once at start-up, and the checks against a config.

Owns the start-up probe (`/v1/models`, `/metrics`, `/server_info`, the token-in/token-out route) and
the errors and warnings that name the server flag to add. Does not own HTTP or retries: the probe
takes any object with the client's `request` coroutine.

What is read where:
- `max_model_len` and the served names (LoRA adapters appear with a `parent`): `GET /v1/models`;
- KV capacity: `kv_cache_size_tokens` of `vllm:cache_config_info` in `GET /metrics`, and the process's start
  time (`process_start_time_seconds`, its identity);
- dtype, `--logprobs-mode`, `--max-logprobs`, `--return-sampling-mask`, LoRA limits, `--watermark`:
  `GET /server_info?config_format=json` (only with `VLLM_SERVER_DEV_MODE=1`; unknown otherwise);
- `--enable-scale-out`: `POST /inference/v1/generate` with an empty body answers 403 without it;
- `--enable-return-routed-experts` (only with `return_routed_experts`): one greedy token of a one-token
  prompt, whose choice must carry `routed_experts` of the config's model shape (no per-request switch
  exists: the server flag alone decides).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ._config import RolloutConfig
from ._exceptions import ResponseFormatError, ServerConfigError
from ._routed_experts import ExpertRouting
from ._server_load import ServerLoad

logger = logging.getLogger("agrpo_rollout")

RECOMMENDED_WATERMARK = 0.15
"""`--watermark` the start-up check recommends for a KV cache that holds fewer full-length requests than the
concurrency bound (measured: `tools/bench/concurrency`, docs/benchmarks.md, issue 22)."""

_WARNED: set[tuple[str, str]] = set()
"""(server, warning) pairs already logged by `probe_server`: each once per process, however often a server is
probed (a loop per benchmark window, a restarted server)."""

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerInfo:
    """Start-up facts about one vLLM server; None where the server does not say."""

    base_url: str
    """The server's base URL."""
    served_models: tuple[str, ...]
    """Names `/v1/models` lists: the base model and any loaded LoRA adapters."""
    model_name: str
    """The name requests use (the config's, or the first served model)."""
    max_model_len: int
    """Longest prompt + completion the server accepts, in tokens."""
    kv_cache_tokens: int | None
    """KV-cache capacity in tokens, summed over engines."""
    dtype: str | None
    """Model dtype as the server reports it, e.g. `torch.bfloat16`."""
    logprobs_mode: str | None
    """`--logprobs-mode`; `processed_logprobs` makes log-probs match the sampling distribution."""
    max_logprobs: int | None
    """`--max-logprobs`: the most top log-probs one request may ask for."""
    return_sampling_mask: bool
    """`--return-sampling-mask`: the engine records each token's candidate set."""
    scale_out: bool
    """`--enable-scale-out`: the token-in/token-out `/inference/v1/generate` route is served."""
    lora_max_loras: int | None
    """`--max-loras`, None when LoRA is off or unknown."""
    lora_max_rank: int | None
    """`--max-lora-rank`, None when LoRA is off or unknown."""
    watermark: float | None = None
    """`--watermark`: the fraction of KV blocks vLLM keeps free when it admits a waiting request; None: unknown."""
    started_at: float | None = None
    """When the server's API process started (`process_start_time_seconds` of `/metrics`); None: not exported."""

    @property
    def uses_generate_endpoint(self) -> bool:
        """Sampling masks come only from the token-in/token-out route, with both flags on."""
        return self.scale_out and self.return_sampling_mask

    @property
    def full_length_requests(self) -> int | None:
        """Requests the KV cache holds at `max_model_len` each; None when its size is unknown."""
        return self.kv_cache_tokens // self.max_model_len if self.kv_cache_tokens else None

    def initial_concurrency(self, bound: int) -> int:
        """Requests that fit at full length, within [1, bound]; the bound on a server with `--watermark`,
        whose own admission keeps room for running requests to grow."""
        if self.full_length_requests is None or self.watermark:
            return bound
        return max(1, min(bound, self.full_length_requests))

    def _check_candidate_sets(self, config: RolloutConfig) -> None:
        """Without sampling masks, top-k/top-p/min-p sets are read from processed top log-probs
        (`_candidate_set.py`); refuse a server that cannot return them, naming the flags."""
        needed = max(config.num_sampler_logprobs, config.top_k + 1)
        fixes = (
            f"--logprobs-mode processed_logprobs --max-logprobs {max(needed, 20)}, or with --enable-scale-out "
            "--return-sampling-mask (vLLM >= 0.28, V2 model runner), or sample without top_k/top_p/min_p"
        )
        what = f"top_k={config.top_k}, top_p={config.top_p}, min_p={config.min_p} truncate the vocabulary"
        if self.logprobs_mode not in (None, "processed_logprobs"):
            raise ServerConfigError(
                f"{what}, but {self.base_url} returns no sampling masks and runs --logprobs-mode "
                f"{self.logprobs_mode}, so no token's candidate set can be known and every importance ratio "
                f"would be biased (the run would train on nothing). Restart it with {fixes}"
            )
        if self.max_logprobs is not None and 0 <= self.max_logprobs < needed:
            raise ServerConfigError(
                f"{what}; without sampling masks each token's candidate set is read from its top "
                f"{needed} log-probs (top_k + 1), but {self.base_url} runs with --max-logprobs {self.max_logprobs}. "
                f"Restart it with {fixes}"
            )

    def check(self, config: RolloutConfig) -> list[str]:
        """Raise `ServerConfigError` for what cannot work; return warnings for what works degraded."""
        templated = (
            config.model_name is not None and "{version}" in config.model_name
        )  # names appear per sync
        if config.model_name is not None and not templated and config.model_name not in self.served_models:
            raise ServerConfigError(
                f"model_name={config.model_name!r} is not served by {self.base_url} (it serves "
                f"{list(self.served_models)}); set model_name to one of those or load the adapter first"
            )
        needed = config.num_sampler_logprobs + (1 if self.uses_generate_endpoint else 0)
        if self.max_logprobs is not None and 0 <= self.max_logprobs < needed:
            raise ServerConfigError(
                f"num_sampler_logprobs={config.num_sampler_logprobs} needs the server to allow {needed} log-probs "
                f"per token but it runs with --max-logprobs {self.max_logprobs}; restart it with "
                f"--max-logprobs {max(needed, 20)} or lower num_sampler_logprobs"
            )
        warnings = []
        reshapes = config.temperature != 1.0 or config.repetition_penalty != 1.0
        if config.truncates_vocabulary and not self.uses_generate_endpoint:
            self._check_candidate_sets(config)
        elif reshapes and self.logprobs_mode not in (None, "processed_logprobs"):
            warnings.append(
                f"the server runs with --logprobs-mode {self.logprobs_mode}: sampler log-probs ignore temperature "
                "and penalties, so importance ratios are biased; restart it with --logprobs-mode processed_logprobs"
            )
        fits = self.full_length_requests
        if self.watermark == 0.0 and fits is not None and fits < config.max_concurrent_rollouts:
            warnings.append(
                f"{self.base_url}'s KV cache holds {fits} full-length requests, fewer than max_concurrent_rollouts="
                f"{config.max_concurrent_rollouts}, and it runs without --watermark: vLLM then admits a waiting "
                "request whenever its prompt fits, leaving running requests no room to grow, so they preempt each "
                f"other and the client must hold its concurrency low. Restart it with --watermark "
                f"{RECOMMENDED_WATERMARK:g}: it keeps that share of the cache free for growth, and the concurrency "
                "rule then feeds it up to the bound (measured on a small-KV CPU server: the tokens/s of the "
                "fastest fixed cap on the default server with a fifth of its preemptions; docs/benchmarks.md)"
            )
        if config.max_completion_length >= self.max_model_len:
            warnings.append(
                f"max_completion_length={config.max_completion_length} >= the server's max_model_len="
                f"{self.max_model_len}; each turn is capped at max_model_len minus its prompt"
            )
        return warnings


def json_body(response: Any) -> Any:
    """A 2xx response's JSON; a body that is not JSON (a proxy's HTML page, a wrong URL) raises
    `ResponseFormatError` naming the URL."""
    try:
        return response.json()
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ResponseFormatError(
            f"{response.request.method} {response.request.url} answered {response.status_code} with a body that "
            f"is not JSON (first bytes: {response.content[:120]!r}); check that the URL is a vLLM server's root"
        ) from exc


def _lora(config: dict[str, Any]) -> tuple[int | None, int | None]:
    lora = config.get("lora_config") or {}
    return lora.get("max_loras"), lora.get("max_lora_rank")


def _watermark(config: dict[str, Any]) -> float | None:
    value = (config.get("scheduler_config") or {}).get("watermark")
    return None if value is None else float(value)


ROUTED_EXPERTS_FLAG_FIX = (
    "start the server with --enable-return-routed-experts (needs Model Runner V2, i.e. a GPU server: vLLM's "
    "CPU build refuses the flag), or set return_routed_experts=False"
)


async def probe_routed_experts(client: Any, routing: ExpertRouting, model_name: str) -> None:
    """Refuse a server that returns no MoE routes (`ServerConfigError` naming the flag) or routes of another
    model's shape (`ResponseFormatError`): one greedy token of the one-token prompt `[0]`."""
    body = {
        "model": model_name,
        "prompt": [0],
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
        "routed_experts_prompt_start": 0,
    }
    choice = json_body(await client.request("POST", COMPLETIONS_PATH, json=body))["choices"][0]
    if choice.get("routed_experts") is None:
        raise ServerConfigError(
            f"return_routed_experts=True, but {client.base_url} returned no routed_experts for a completion: "
            f"{ROUTED_EXPERTS_FLAG_FIX}"
        )
    num_tokens = 1 + len(choice.get("token_ids") or [])
    request = f"the start-up probe's completion on {client.base_url}"
    routing.decode(choice["routed_experts"], num_tokens=num_tokens, prompt_start=0, request=request)


async def probe_server(client: Any, config: RolloutConfig) -> ServerInfo:
    """Read the facts of `ServerInfo` through `client.request(method, path, ...)`, then `check` them."""
    models = json_body(await client.request("GET", "/v1/models"))["data"]
    names = tuple(m["id"] for m in models)
    model_name = config.model_name if config.model_name and "{version}" not in config.model_name else names[0]
    by_name = {m["id"]: m for m in models}
    entry = by_name.get(model_name) or by_name[names[0]]
    root = by_name.get(entry.get("parent") or "", entry)
    metrics = await client.request("GET", "/metrics", allow_status=(404,))
    load = ServerLoad.from_text(metrics.text) if metrics.status_code == 200 else None
    info = await client.request("GET", "/server_info", params={"config_format": "json"}, allow_status=(404,))
    vllm_config = json_body(info).get("vllm_config", {}) if info.status_code == 200 else {}
    model_config = vllm_config.get("model_config", {}) if isinstance(vllm_config, dict) else {}
    probe = await client.request("POST", GENERATE_PATH, json={}, allow_status=(400, 403, 404, 405, 422))
    max_loras, max_rank = _lora(vllm_config) if isinstance(vllm_config, dict) else (None, None)
    server = ServerInfo(
        base_url=client.base_url,
        served_models=names,
        model_name=model_name,
        max_model_len=int(entry.get("max_model_len") or root.get("max_model_len")),
        kv_cache_tokens=load.kv_cache_tokens if load is not None else None,
        dtype=model_config.get("dtype"),
        logprobs_mode=model_config.get("logprobs_mode"),
        max_logprobs=model_config.get("max_logprobs"),
        return_sampling_mask=bool(model_config.get("return_sampling_mask", False)),
        scale_out=probe.status_code in (400, 422),
        lora_max_loras=max_loras,
        lora_max_rank=max_rank,
        watermark=_watermark(vllm_config) if isinstance(vllm_config, dict) else None,
        started_at=load.started_at if load is not None else None,
    )
    if not vllm_config:
        logger.warning(
            "%s has no /server_info (start it with VLLM_SERVER_DEV_MODE=1 to expose it); dtype, "
            "--logprobs-mode, --max-logprobs and --return-sampling-mask cannot be checked",
            client.base_url,
        )
    if config.expert_routing is not None:
        await probe_routed_experts(client, config.expert_routing, model_name)
    for warning in server.check(config):
        if (client.base_url, warning) not in _WARNED:
            _WARNED.add((client.base_url, warning))
            logger.warning(warning)
    return server
