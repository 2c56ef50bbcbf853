"""`ServerControl`: the HTTP control plane of one vLLM server, as agrpo-sync uses it; and `ServerInfo`.

Owns the endpoints (dev mode: pause/resume, weight transfer, `collective_rpc`, `server_info`, the weight
label; runtime LoRA: load/unload adapter), their timeouts, and turning every failure into a
`ServerRequestError` that names the endpoint, the status and the body; a call that failed at transport
level is followed by one `GET /health` on a fresh connection, and when that cannot connect either the
error is a `ServerUnreachableError` (the process is gone: a sync to several servers leaves it out). A
timeout is never "unreachable": a server stuck in a transfer still holds its port. Does not know NCCL,
models or when a sync happens.

vLLM 0.32 and 0.33 take the same bodies for every call made here; the one difference that matters
(0.33 accepts empty `update_weights` lists as "same metadata as last time") is not used: full lists
always go out. Calls that block on the transfer (`init_weight_transfer`, `update_weights`,
`reload_weights`) use the long timeout and go through their own client, since they run on a
background thread beside the trainer's half of the rendezvous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from ._exceptions import ServerRequestError, ServerUnreachableError


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerInfo:
    """What the start-up checks need to know about the server (from `/server_info`, `/version`, `/v1/models`)."""

    version: str
    """vLLM version, e.g. `0.32.0`."""
    dtype: str
    """Model dtype the server runs, e.g. `bfloat16`."""
    device: str
    """`cuda`, `cpu`, ... (vLLM's device config)."""
    model_root: str
    """Where the served base model came from (a local directory or a hub id)."""
    data_parallel_size: int
    lora_enabled: bool
    max_lora_rank: int
    max_loras: int
    runtime_lora_updating: bool
    """Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is on (needed by `/v1/load_lora_adapter`)."""
    weight_transfer_backend: str | None
    """`--weight-transfer-config` backend, or None when the flag is absent."""


def _dtype_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes"}


def parse_server_info(info: dict, version: str, model_root: str) -> ServerInfo:
    """`ServerInfo` from `/server_info?config_format=json` (the `vllm_config` and `vllm_env` sections)."""
    config = info.get("vllm_config") or {}
    lora = config.get("lora_config") or {}
    transfer = config.get("weight_transfer_config") or {}
    env = info.get("vllm_env") or {}
    return ServerInfo(
        version=version,
        dtype=_dtype_name((config.get("model_config") or {}).get("dtype", "")),
        device=str((config.get("device_config") or {}).get("device", "")),
        model_root=model_root,
        data_parallel_size=int((config.get("parallel_config") or {}).get("data_parallel_size", 1)),
        lora_enabled=bool(lora),
        max_lora_rank=int(lora.get("max_lora_rank", 0)),
        max_loras=int(lora.get("max_loras", 0)),
        runtime_lora_updating=_truthy(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False)),
        weight_transfer_backend=transfer.get("backend") if transfer else None,
    )


KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle pooled connection is reused. vLLM's server (uvicorn) closes an idle connection after
`VLLM_HTTP_TIMEOUT_KEEP_ALIVE` = 5 s; httpx's default of 5 s too makes a request reusing a connection the
server is closing at that instant fail with a reset. Well under the server's limit, that never happens."""


class ServerControl:
    """HTTP calls to one vLLM server; every failure raises `ServerRequestError`."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, transfer_timeout_s: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._client = self._new_client(timeout_s)
        self._blocking = self._new_client(transfer_timeout_s)

    def _new_client(self, timeout_s: float) -> httpx.Client:
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
        return httpx.Client(base_url=self.base_url, timeout=timeout_s, limits=limits)

    def close(self) -> None:
        self._client.close()
        self._blocking.close()

    def renew_connections(self) -> None:
        """Drop every pooled connection: the next calls open fresh ones (vLLM closes the connection of a
        `collective_rpc` it answered 500, and a call reusing it fails with a connection reset)."""
        old = (self._client, self._blocking)
        self._client = self._new_client(self.timeout_s)
        self._blocking = self._new_client(self.transfer_timeout_s)
        for client in old:
            client.close()

    def _call(self, method: str, path: str, *, blocking: bool = False, **kwargs: Any) -> httpx.Response:
        client = self._blocking if blocking else self._client
        try:
            response = client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            self.renew_connections()  # the process may be gone, and every pooled connection with it
            detail = f"{type(error).__name__}: {error}"
            timed_out = isinstance(error, httpx.TimeoutException) and not isinstance(
                error, httpx.ConnectTimeout
            )
            if not timed_out and not self.answers():
                raise ServerUnreachableError(f"{method} {self.base_url}{path}", None, detail) from error
            raise ServerRequestError(f"{method} {path}", None, detail) from error
        if response.status_code >= 500:
            self.renew_connections()  # the server may close this connection after an internal error
        if 300 <= response.status_code < 400:
            raise ServerRequestError(
                f"{method} {path}",
                response.status_code,
                f"a redirect to {response.headers.get('location')!r}; agrpo-sync never follows redirects (control "
                "calls go to the configured server only): set base_url to the server itself",
            )
        if response.status_code >= 400:
            raise ServerRequestError(f"{method} {path}", response.status_code, response.text[:2000])
        return response

    def answers(self) -> bool:
        """Whether a fresh connection reaches the server (any answer to `GET /health`, even a slow one)."""
        try:
            self._client.get("/health", timeout=min(5.0, self.timeout_s))
        except (httpx.ConnectError, httpx.ConnectTimeout):
            return False
        except httpx.HTTPError:  # it accepted the connection: it is there, if unwell
            return True
        return True

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._call(method, path, **kwargs)
        return response.json() if response.content else None

    # -- generation control
    def pause(self, mode: str, clear_cache: bool) -> None:
        self._call("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused")["is_paused"])

    # -- NCCL weight transfer (dev mode RL routes)
    def world_size(self) -> int:
        return int(self._json("GET", "/get_world_size")["world_size"])

    def init_weight_transfer(self, init_info: dict) -> None:
        self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, blocking=True)

    def shutdown_weight_transfer(self) -> None:
        self._call("POST", "/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("POST", "/update_weights", json={"update_info": update_info}, blocking=True)

    def finish_weight_update(self, weight_version: str | None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._call("POST", "/finish_weight_update", json=body)

    def weight_info(self) -> dict:
        """`/weight_info` as the server answers it (vLLM 0.32/0.33: only `weight_version`)."""
        answer = self._json("GET", "/weight_info")
        return answer if isinstance(answer, dict) else {}

    def weight_version(self) -> str:
        return str(self.weight_info()["weight_version"])

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": version})

    # -- disk reload and prefix cache (dev mode)
    def reload_weights(self, weights_path: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
        self._call("POST", "/collective_rpc", json=body, blocking=True)

    def reset_prefix_cache(self) -> bool:
        answer = self._json("POST", "/reset_prefix_cache")
        return bool(answer.get("success", False)) if isinstance(answer, dict) else True

    # -- runtime LoRA
    def load_lora_adapter(self, name: str, path: str, *, inplace: bool = False) -> None:
        """Register adapter `name` from `path`; `inplace` replaces a registered adapter of that name."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        self._call("POST", "/v1/load_lora_adapter", json=body)

    def unload_lora_adapter(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    # -- discovery
    def models(self) -> list[dict]:
        return list(self._json("GET", "/v1/models")["data"])

    def server_info(self) -> ServerInfo:
        version = str(self._json("GET", "/version").get("version", "unknown"))
        base = [m for m in self.models() if not m.get("parent")]
        root = str(base[0].get("root") or base[0]["id"]) if base else ""
        info = self._json("GET", "/server_info", params={"config_format": "json"})
        return parse_server_info(info, version, root)
