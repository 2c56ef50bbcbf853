"""`ExpertRouting`: the MoE routes vLLM returns per token (routing replay), decoded and checked.

Owns what a route array must look like for one model (layers, experts per token, expert count, read from
the model's config), the decoding of vLLM's wire form into one int16 route per token, and the rule that
merges the routes two requests reported for the same tokens. Does not know HTTP (the client asks for the
routes), turns or packing.

The wire form, as vLLM 0.32 writes it (`vllm/utils/serial_utils.py` `numpy2base64`, called by
`vllm/entrypoints/openai/completion/serving.py` and `.../scale_out/token_in_token_out/serving.py`):
`choices[i].routed_experts` is base64 of `np.save(..., allow_pickle=False)` of an array of shape
(prompt + completion - 1 - routed_experts_prompt_start, num_hidden_layers, num_experts_per_tok), dtype
uint8 when the model has at most 256 experts, else uint16 (`routed_experts_capturer.py`; the protocol
comment also allows int32). Row j is the route of token `routed_experts_prompt_start + j` as input; the
last sampled token was never forwarded, so it has none. Dense layers hold zeros. A request sets
`routed_experts_prompt_start` (0 to prompt length) to skip prompt tokens whose routes it already has;
prefix-cached tokens are still returned (vLLM stores routes with the KV blocks, so a cached prefix
reports the routes it was computed with). The field is absent unless the server runs with
`--enable-return-routed-experts`, which needs Model Runner V2 (Triton, a GPU server).

Cost: one `b64decode` and one `np.load` per response, a few vectorised checks, one int16 copy; nothing
per token in Python, and nothing at all unless `RolloutConfig.return_routed_experts` is on.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._exceptions import ResponseFormatError

NO_ROUTE = -1
"""Every slot of a token without a route holds this."""
_LAYER_KEYS = ("num_hidden_layers",)
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k_experts")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MAX_EXPERTS = np.iinfo(np.int16).max + 1


def _first(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key):
            return config[key]
    return None


def routed_tokens(routes: np.ndarray) -> np.ndarray:
    """(L,) bool: which tokens of an (L, layers, top_k) route array carry a route."""
    return (routes != NO_ROUTE).any(axis=(1, 2))


def merge_routes(kept: np.ndarray, later: np.ndarray) -> tuple[np.ndarray, int]:
    """`kept` with its route-less tokens taken from `later` (same tokens, another request), and the number
    of tokens both route to different expert sets; `kept` wins those (see `_sequence.py` for why)."""
    kept_has, later_has = routed_tokens(kept), routed_tokens(later)
    fill = later_has & ~kept_has
    merged = kept.copy() if fill.any() else kept
    merged[fill] = later[fill]
    both = kept_has & later_has
    differ = both & (kept != later).any(axis=(1, 2))
    if not differ.any():
        return merged, 0
    same_set = (np.sort(kept[differ], axis=-1) == np.sort(later[differ], axis=-1)).all(axis=(1, 2))
    return merged, int((~same_set).sum())


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertRouting:
    """The shape of one MoE model's routes, from its config; `decode` checks responses against it."""

    num_hidden_layers: int
    """Layers of the model, dense ones included (vLLM returns a zero route for those)."""
    num_experts_per_tok: int
    """Experts each token is routed to per layer (top_k)."""
    num_experts: int
    """Routed experts per MoE layer; every expert id is below it."""

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any] | Any) -> ExpertRouting:
        """From a model's `config.json` as a dict, or a transformers config (`.to_dict()` is read); a
        vision-language config's `text_config` is used. A dense model is refused."""
        config = model_config.to_dict() if hasattr(model_config, "to_dict") else model_config
        if not isinstance(config, Mapping):
            raise TypeError(
                f"model_config is a {type(model_config).__name__}; pass the model's config.json as a dict or "
                "its transformers config (model.config)"
            )
        text = config.get("text_config")
        config = {**config, **text} if isinstance(text, Mapping) else config
        layers, top_k = _first(config, _LAYER_KEYS), _first(config, _TOP_K_KEYS)
        experts = _first(config, _EXPERT_KEYS)
        if isinstance(experts, list):  # some remote-code configs list one count per layer, all equal
            experts = max(experts)
        if not experts or not top_k:
            raise ValueError(
                f"return_routed_experts=True, but model_config (model_type={config.get('model_type')!r}) is a "
                f"dense model: it sets none of {list(_EXPERT_KEYS)} with {list(_TOP_K_KEYS)}, so there are no "
                "routes to replay; set return_routed_experts=False, or pass the config of the MoE model served"
            )
        if not layers or not 0 < int(experts) <= _MAX_EXPERTS:
            raise ValueError(
                f"model_config has num_hidden_layers={layers}, num_experts={experts}; routing replay needs "
                f"num_hidden_layers >= 1 and 1 <= num_experts <= {_MAX_EXPERTS}"
            )
        return cls(num_hidden_layers=int(layers), num_experts_per_tok=int(top_k), num_experts=int(experts))

    def unrouted(self, num_tokens: int) -> np.ndarray:
        """(num_tokens, layers, top_k) int16 of -1: tokens no request forwarded."""
        shape = (num_tokens, self.num_hidden_layers, self.num_experts_per_tok)
        return np.full(shape, NO_ROUTE, dtype=np.int16)

    def decode(self, encoded: str | None, *, num_tokens: int, prompt_start: int, request: str) -> np.ndarray:
        """(num_tokens, layers, top_k) int16 routes of prompt + output tokens from `choices[i].routed_experts`;
        -1 before `prompt_start` and at the last token. `request` names the response in errors."""
        if encoded is None:
            raise ResponseFormatError(
                f"{request} has no routed_experts although the request asked for them (return_routed_experts="
                "True); start the server with --enable-return-routed-experts (needs Model Runner V2, i.e. a GPU "
                "server, vLLM >= 0.32), or set return_routed_experts=False"
            )
        try:
            routes = np.load(io.BytesIO(base64.b64decode(encoded)))  # numpy's default refuses pickled objects
        except (binascii.Error, ValueError, EOFError) as exc:  # not base64, not an .npy payload
            raise ResponseFormatError(
                f"{request}: routed_experts is not base64 of an .npy array ({exc}); is the server vLLM >= 0.32?"
            ) from exc
        expected = max(num_tokens - 1 - prompt_start, 0)
        self._check(routes, expected, request)
        out = self.unrouted(num_tokens)
        out[prompt_start : prompt_start + expected] = routes
        return out

    def _check(self, routes: np.ndarray, expected_tokens: int, request: str) -> None:
        """Shape, dtype and expert ids of a decoded array; errors name what differs and the likely cause."""
        shape = (expected_tokens, self.num_hidden_layers, self.num_experts_per_tok)
        if routes.ndim != 3 or routes.dtype.kind not in "iu":
            raise ResponseFormatError(
                f"{request}: routed_experts is a {routes.ndim}-D {routes.dtype} array, expected {shape} of "
                "integer expert ids"
            )
        if routes.shape[1:] != shape[1:]:
            raise ResponseFormatError(
                f"{request}: routed_experts has {routes.shape[1]} layers x {routes.shape[2]} experts per token, "
                f"the model config has num_hidden_layers={shape[1]}, num_experts_per_tok={shape[2]}: the "
                "server serves another model than the config describes; pass the served model's config"
            )
        if routes.shape[0] != expected_tokens:
            raise ResponseFormatError(
                f"{request}: routed_experts has {routes.shape[0]} tokens, expected {expected_tokens} (prompt + "
                "completion - 1 - routed_experts_prompt_start); the server's routes do not match its tokens"
            )
        if routes.size and (int(routes.max()) >= self.num_experts or int(routes.min()) < 0):
            token, layer, slot = (int(i) for i in np.argwhere((routes >= self.num_experts) | (routes < 0))[0])
            raise ResponseFormatError(
                f"{request}: routed_experts names expert {int(routes[token, layer, slot])} (token "
                f"{token} of the returned span, layer {layer}), outside [0, num_experts={self.num_experts}); "
                "the server serves another model than the config describes"
            )
