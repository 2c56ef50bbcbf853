"""Fixtures of agrpo-sync's tests: a fault-injecting proxy in front of the real server, log-prob probes,
the stub worker for the NCCL protocol (CPU, gloo), restoring the shared server after a test, and a limit
on the size of the files this process writes (a real "File too large")."""

from __future__ import annotations

import httpx
import pytest
import torch

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_sync import ServerControl
from tools.bench.weight_sync.gloo_transport import GlooTransport
from tools.bench.weight_sync.stub_worker import StubWorker
from tools.file_size_limit import file_size_limit as file_size_limit_cm
from tools.loopback_http import LoopbackHTTP

PROMPT = "What is 12 + 30? The answer is 42. The weather in the city is hot"


class FaultProxy:
    """Forwards every request to the real server, except those matching an armed fault.

    `arm(path, mode, contains)`: requests to `path` whose body contains `contains` are answered 500,
    `before` without forwarding them, `after` once the real server has handled them.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.faults: dict[str, tuple[str, str]] = {}
        self.client = httpx.Client(timeout=600)
        self.server: LoopbackHTTP | None = None

    def arm(self, path: str, mode: str, contains: str = "") -> None:
        self.faults[path] = (mode, contains)

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        mode, contains = self.faults.get(path.split("?")[0], ("", ""))
        if mode and contains.encode() not in body:
            mode = ""
        if mode == "before":
            return 500, b'{"error": "injected fault before forwarding"}'
        headers = {"content-type": "application/json"} if body else {}
        response = self.client.request(method, self.target + path, content=body, headers=headers)
        if mode == "after":
            return 500, b'{"error": "injected fault after forwarding"}'
        return response.status_code, response.content

    def start(self) -> str:
        self.server = LoopbackHTTP(self._answer)
        return self.server.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.client.close()


class LogProbs:
    """Log-probs of a fixed prompt's tokens, from the server and from a trainer-side model."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ids = build_tokenizer().encode(PROMPT)

    def server(self, model_name: str) -> torch.Tensor | int:
        """The server's prompt log-probs under `model_name` (a base model or adapter); the HTTP status on error."""
        body = {
            "model": model_name,
            "prompt": self.ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        if response.status_code != 200:
            return response.status_code
        rows = response.json()["choices"][0]["prompt_logprobs"]
        return torch.tensor([rows[i][str(self.ids[i])]["logprob"] for i in range(1, len(self.ids))])

    @torch.no_grad()
    def trainer(self, model: torch.nn.Module) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([self.ids])).logits.float()
        return logits.log_softmax(-1)[0, :-1].gather(1, torch.tensor(self.ids[1:])[:, None])[:, 0]


def _tiny_model() -> torch.nn.Module:
    return build_model(TinyModelSpec(), build_tokenizer())


@torch.no_grad()
def _perturb(
    model: torch.nn.Module, seed: int, *, skip: str = "embed_tokens", only: str = "", scale: float = 0.05
) -> None:
    """Add seeded noise to parameters (the tied embedding is skipped: see the CPU server note in the README)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if (skip and skip in name) or (only and only not in name):
            continue
        param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))


@pytest.fixture
def tiny_model():
    """Builds the trainer's copy of the shared server's model (same spec and seed as `tiny_qwen3_dir`)."""
    return _tiny_model


@pytest.fixture
def perturb():
    """`perturb(model, seed, skip=..., only=..., scale=...)`: seeded noise on the chosen parameters."""
    return _perturb


@pytest.fixture
def logprobs(vllm_server) -> LogProbs:
    return LogProbs(vllm_server.url)


@pytest.fixture
def fault_proxy(vllm_server):
    proxy = FaultProxy(vllm_server.url)
    url = proxy.start()
    proxy.url = url
    yield proxy
    proxy.stop()


@pytest.fixture
def restore_server(vllm_server, tiny_qwen3_dir):
    """Give the shared server back as found: original weights, version label, resumed, no adapters of ours."""
    yield
    control = ServerControl(vllm_server.url)
    control.resume()
    control.reload_weights(str(tiny_qwen3_dir))
    control.set_weight_version("default")
    for model in control.models():
        if model.get("parent") and str(model["id"]).startswith("agrpo-test"):
            control.unload_lora_adapter(model["id"])
    control.close()


@pytest.fixture
def stub_worker():
    """A stub vLLM worker speaking the NCCL weight-transfer protocol over gloo, on a local port."""
    worker = StubWorker(transport=GlooTransport(timeout_s=20), dtype="float32")
    server = worker.serve()
    worker.url = server.url
    yield worker
    worker.released.set()
    server.stop()


@pytest.fixture
def file_size_limit():
    """`with file_size_limit(n):` files this process writes may not exceed n bytes; writing more fails with
    the OS's "File too large" (EFBIG), as a full or quota-limited disk would."""
    return file_size_limit_cm
