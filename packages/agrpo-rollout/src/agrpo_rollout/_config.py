"""`RolloutConfig`: every knob of the rollout package, with the reference trainer's parameter names.

Owns the fields, their defaults and the checks that need no server. Does not know the trainer: the
trainer's `AsyncGRPOConfig` builds one of these from its own fields (for example it sets
`max_concurrent_rollouts` to `max(max_staleness, 1) * per_device_train_batch_size *
gradient_accumulation_steps * num_processes`). Checks that need the server (max_model_len,
--max-logprobs, --enable-scale-out) live in `_server.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ._routed_experts import ExpertRouting

logger = logging.getLogger("agrpo_rollout")

CLIENT_REQUEST_FIELDS = frozenset(
    {
        "model", "prompt", "token_ids", "sampling_params", "max_tokens", "n", "logprobs", "return_token_ids",
        "return_tokens_as_token_ids", "skip_special_tokens", "detokenize", "temperature", "top_p", "top_k",
        "min_p", "repetition_penalty", "seed", "routed_experts_prompt_start",
    }
)  # fmt: skip
"""Request fields `VLLMClient` sets itself from the config (both routes); `extra_request_fields` may not."""
CONCURRENCY_CONTROLS = ("goodput", "kv_usage", "fixed")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Sampling, server and concurrency settings of one rollout loop or eval run."""

    vllm_server_base_url: str | list[str] = "http://localhost:8000"
    """Root URL of the vLLM server, e.g. `http://localhost:8000`, or a list of several servers serving the same
    model: each group goes to one of them, balanced by their live concurrency caps (`ServerPool`)."""
    model_name: str | None = None
    """Served model or LoRA adapter name sent as `model`; None: the first model `/v1/models` lists. A
    template with `{version}` (e.g. `agrpo-policy-v{version}`, LoRA adapter sync) names, per request, the
    adapter of the policy version its group started at."""
    num_generations: int = 8
    """Rollouts per prompt (the GRPO group size), >= 1; groups need >= 2 to yield advantages."""
    max_completion_length: int = 2048
    """Generated tokens per rollout, summed over all its turns, >= 1."""
    temperature: float = 1.0
    """Sampling temperature, >= 0 (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; < 1 needs `top_k > 0` (the server bounds candidate sets by top_k)."""
    top_k: int = 0
    """Top-k filter, 0 disables; > 0 asks the server for sampling masks when it can return them."""
    min_p: float | None = None
    """Minimum probability relative to the most likely token, in [0, 1]; needs `top_k > 0`."""
    repetition_penalty: float = 1.0
    """vLLM repetition penalty, > 0; 1.0 disables."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for `apply_chat_template`, e.g. `{"enable_thinking": False}`."""
    max_tool_calling_iterations: int | None = None
    """Most tool-calling rounds per rollout; None: until the model stops calling tools or the budget ends."""
    num_sampler_logprobs: int = 8
    """Top sampler log-probs returned per generated token (score centering), 0..server --max-logprobs."""
    max_concurrent_rollouts: int = 64
    """Upper bound on rollouts in flight; the live cap moves below it (`concurrency_control`)."""
    concurrency_control: str = "goodput"
    """How the live cap moves under the bound: `goodput` (keep the server's KV cache nearly full without
    preempting), `kv_usage` (the reference's rule, SPEC F-CONC) or `fixed` (the cap is the bound)."""
    vllm_server_timeout: float = 1800.0
    """Seconds one HTTP request may take before it is retried, and how long the loop waits while no server
    serves (a restart) before it fails with `ServerUnavailableError`, > 0."""
    vllm_max_retries: int = 8
    """Retries of one request on connection errors, 5xx and timeouts before giving up, >= 0."""
    vllm_retry_backoff_s: float = 0.5
    """First retry delay in seconds; it doubles per attempt, capped at 16 s."""
    metrics_poll_interval_s: float = 2.0
    """Seconds between two reads of the server's `/metrics` by the concurrency controller, > 0."""
    score_queue_maxsize: int = 16
    """Finished groups waiting to be scored before generation blocks (`rollout/score_block_s`), >= 1."""
    metrics_interval_s: float = 5.0
    """Seconds between two metric pushes of a running loop to its `metrics_sink`, > 0."""
    tool_timeout_s: float | None = 300.0
    """Seconds one tool call may take before it becomes an error message to the model, > 0; None waits forever."""
    tool_threads: int | None = None
    """Threads for sync tools, rewards and environments; None: `max_concurrent_rollouts`."""
    seed: int | None = None
    """Sampling seed, >= 0: each request gets its own seed derived from it, the prompt's row and epoch,
    the rollout's index in its group and the request's index in the rollout, so a run repeats and the
    rollouts of a group still differ. None: unseeded."""
    extra_request_fields: dict[str, Any] = field(default_factory=dict)
    """Extra fields merged into every sampling request (e.g. `{"stop": ["</answer>"]}`); none of
    `CLIENT_REQUEST_FIELDS`, which the fields above set."""
    return_routed_experts: bool = False
    """MoE routing replay: decode the experts the server routed every token to (`TurnRecord`,
    `RolloutSample.routed_experts`) and check their shape against `model_config`. Needs a server started
    with `--enable-return-routed-experts` (Model Runner V2: a GPU server); refused at start-up otherwise."""
    model_config: dict[str, Any] | None = None
    """The served model's `config.json` as a dict (the trainer passes `model.config.to_dict()`): its
    `num_hidden_layers`, `num_experts_per_tok` and `num_experts` / `num_local_experts` bound the routes.
    Required by `return_routed_experts`, unused otherwise."""

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_server_url()
        self._check_extra_request_fields()
        positive = {
            "num_generations": self.num_generations,
            "max_completion_length": self.max_completion_length,
            "max_concurrent_rollouts": self.max_concurrent_rollouts,
            "score_queue_maxsize": self.score_queue_maxsize,
            "vllm_server_timeout": self.vllm_server_timeout,
            "metrics_poll_interval_s": self.metrics_poll_interval_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name}={value}; it must be > 0")
        if self.num_sampler_logprobs < 0 or self.vllm_max_retries < 0:
            raise ValueError(
                f"num_sampler_logprobs={self.num_sampler_logprobs}, vllm_max_retries={self.vllm_max_retries}; "
                "both must be >= 0"
            )
        if self.tool_timeout_s is not None and not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s={self.tool_timeout_s}; use None (wait forever) or seconds > 0")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations}; use None or >= 0"
            )
        self._check_routed_experts()

    def _check_routed_experts(self) -> None:
        if self.return_routed_experts and self.model_config is None:
            raise ValueError(
                "return_routed_experts=True needs model_config, the served model's config.json as a dict (e.g. "
                "model.config.to_dict()), to check the routes' layers, experts per token and expert ids"
            )
        if self.return_routed_experts:
            ExpertRouting.from_model_config(self.model_config)  # a dense model is refused here, up front
        elif self.model_config is not None:
            logger.warning("model_config is set but return_routed_experts=False: it is not used")

    @property
    def server_urls(self) -> tuple[str, ...]:
        """`vllm_server_base_url` as a tuple of roots without a trailing slash (one entry for one server)."""
        urls = (
            [self.vllm_server_base_url]
            if isinstance(self.vllm_server_base_url, str)
            else self.vllm_server_base_url
        )
        return tuple(str(url).rstrip("/") for url in urls)

    def _check_server_url(self) -> None:
        urls = self.server_urls
        if not urls:
            raise ValueError("vllm_server_base_url is an empty list; give one server's root URL or several")
        if len(set(urls)) < len(urls):
            raise ValueError(f"vllm_server_base_url={list(urls)} names a server twice; list each server once")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"vllm_server_base_url={self.vllm_server_base_url!r}; give the server's root with its scheme, "
                    "e.g. http://localhost:8000"
                )
            if url.endswith("/v1"):
                raise ValueError(
                    f"vllm_server_base_url={self.vllm_server_base_url!r} ends in /v1; pass the server's root "
                    f"({url[:-3]}): the client adds /v1/completions and the other routes itself"
                )

    def _check_extra_request_fields(self) -> None:
        taken = sorted(CLIENT_REQUEST_FIELDS & set(self.extra_request_fields))
        if taken:
            raise ValueError(
                f"extra_request_fields sets {taken}, which the client sets itself from the config; set the "
                "RolloutConfig fields instead (temperature, top_p, top_k, min_p, repetition_penalty, "
                "num_sampler_logprobs for logprobs, max_completion_length for max_tokens, seed, model_name)"
            )
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed={self.seed}; use None or an integer >= 0")
        if self.concurrency_control not in CONCURRENCY_CONTROLS:
            raise ValueError(
                f"concurrency_control={self.concurrency_control!r}; use one of {list(CONCURRENCY_CONTROLS)}"
            )

    def _check_sampling(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}; it must be in (0, 1]")
        if self.top_k < 0 or self.temperature < 0 or self.repetition_penalty <= 0:
            raise ValueError(
                f"top_k={self.top_k}, temperature={self.temperature}, repetition_penalty="
                f"{self.repetition_penalty}; expected top_k >= 0, temperature >= 0, repetition_penalty > 0"
            )
        if self.top_p < 1.0 and self.top_k == 0:
            raise ValueError(
                f"top_p={self.top_p} needs top_k > 0: vLLM bounds the candidate set it reports by top_k. "
                "Set top_k (e.g. top_k=512) or top_p=1.0."
            )
        if self.min_p is not None and (not 0.0 <= self.min_p <= 1.0 or self.top_k == 0):
            raise ValueError(
                f"min_p={self.min_p} needs 0 <= min_p <= 1 and top_k > 0; set top_k or min_p=None"
            )

    @property
    def expert_routing(self) -> ExpertRouting | None:
        """The routes' expected shape when `return_routed_experts` is on, else None."""
        if not self.return_routed_experts or self.model_config is None:
            return None
        return ExpertRouting.from_model_config(self.model_config)

    @property
    def truncates_vocabulary(self) -> bool:
        """True when top-k/top-p/min-p restrict the candidate set, so sampling masks matter."""
        return self.top_k > 0 or self.top_p < 1.0 or bool(self.min_p)

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling parameters every request carries, by vLLM's names."""
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            # Explicit so a server started with `--generation-config auto` cannot substitute its own.
            "min_p": 0.0 if self.min_p is None else self.min_p,
        }
        return fields
