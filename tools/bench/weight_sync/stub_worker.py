"""`StubWorker`: a protocol-level stand-in for a vLLM server's weight-transfer side, for tests and benchmarks.

Owns an HTTP server (stdlib) answering the routes agrpo-sync calls (`/get_world_size`,
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/pause`, `/resume`, `/server_info`, `/v1/load_lora_adapter`, ...) with vLLM 0.32's rules: the init
payload's keys and base64 unique id are validated like `NCCLWeightTransferInitInfo`; start/update/finish
must come in that order; packed chunks are received by re-deriving their boundaries from the metadata
with the worker's loop (written here independently of agrpo-sync's planner) and "loaded" by copying
into per-name tensors. LoRA adapters are loaded with the steps of vLLM 0.32's worker
(`LoRAModel.from_local_checkpoint` with device "cpu", then activation into GPU slots): every tensor read on
the host, cast to the served dtype, pinned (on a GPU machine), then copied to the device; the seconds each
load took are kept for the benchmark (`/bench/lora_loads`). Fault knobs make it fail the way a real
worker can. Does not run a model: it stands in only where a real server cannot (NCCL needs a GPU server;
the GPU machine has no vLLM).

Run alone (the benchmark does, on another GPU): `python -m tools.bench.weight_sync.stub_worker --port P
--transport nccl --device 1`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import threading
import time
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import torch
from safetensors import safe_open

from tools.loopback_http import LoopbackHTTP

INIT_KEYS = {
    "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
    "packed", "packed_buffer_size_bytes", "packed_num_buffers",
}  # fmt: skip


class WorkerError(Exception):
    """Answered as HTTP 500 with the message, like a failing engine call."""


class StubWorker:
    """The worker side of the weight-transfer protocol, plus the HTTP routes around it."""

    def __init__(
        self, *, transport, device: str = "cpu", dtype: str = "bfloat16", lora: dict | None = None
    ) -> None:
        self.transport = transport
        self.device = torch.device(device)
        self.dtype = dtype
        self.lora = lora or {}
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.pinned: dict[str, dict[str, torch.Tensor]] = {}
        """The host copies of each loaded adapter (GPU receivers only)."""
        self.lora_load_s: list[float] = []
        """Seconds of each adapter load (read, cast, pin, copy to the device), in order."""
        self.state = {"paused": False, "started": False, "version": "default", "packed": None}
        self.fail_init = False
        self.receive = True
        """False: a protocol-only stub with no NCCL rank (world size 0), for single-GPU overhead runs."""
        self.fail_update_after_chunks: int | None = None
        self.fail_update_times: int | None = None
        """How many updates the armed `fail_update_after_chunks` fault hits before it disarms (None: all)."""
        self.reject_update = False
        self.reject_start = False
        self.stall_update = False
        """True: `/update_weights` hangs (as if blocked inside NCCL) until `released` is set."""
        self.released = threading.Event()
        self.chunks_received = 0

    # -- weight transfer (the worker's half)
    def _bind_device(self) -> None:
        """HTTP handler threads start on CUDA device 0; bind them to the receiver's device."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def init_engine(self, info: dict) -> None:
        self._bind_device()
        if self.fail_init:
            raise WorkerError("Cannot access accelerator device when none is available.")
        if unknown := set(info) - INIT_KEYS:
            raise WorkerError(f"Invalid init_info: unknown keys {sorted(unknown)}")
        try:
            uid = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
        except (KeyError, ValueError, binascii.Error) as error:
            raise WorkerError(f"nccl_unique_id_b64 is missing or not standard base64: {error}") from error
        if len(uid) != 128:
            raise WorkerError(f"nccl_unique_id_b64 must decode to 128 bytes, got {len(uid)}")
        self.state["packed"] = (
            bool(info.get("packed", False)),
            int(info.get("packed_buffer_size_bytes", 1 << 30)),
        )
        self.num_buffers = int(info.get("packed_num_buffers", 2))
        if not self.receive:
            return
        self.transport.connect(uid, int(info["rank_offset"]), int(info["world_size"]))

    def update(self, info: dict) -> None:
        self._bind_device()
        if not self.state["started"]:
            raise WorkerError("start_weight_update must be called before update_weights")
        if self.reject_update:
            raise WorkerError("update_weights rejected before any chunk (injected)")
        if self.stall_update:
            self.released.wait()
            raise WorkerError("update_weights stalled (injected), then released")
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise WorkerError("`dtype_names` and `shapes` should be of the same size as `names`")
        packed, buffer_size = self.state["packed"]
        if not packed:
            raise WorkerError("the stub only speaks packed transfers")
        metas = [(n, getattr(torch, d), list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if not self.receive:
            return
        self.chunks_received = 0
        group: list = []
        total = 0
        for meta in metas:  # the worker's loop: close a chunk once its total exceeds the buffer size
            group.append(meta)
            total += math.prod(meta[2]) * meta[1].itemsize
            if total > buffer_size:
                self._receive(group, total)
                group, total = [], 0
        if group:
            self._receive(group, total)
        self.transport.synchronize(lambda: False, 600.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _receive(self, metas: list, nbytes: int) -> None:
        slot = self.chunks_received % self.num_buffers
        self.transport.wait_slot(slot, lambda: False, 600.0)
        with self.transport.slot(slot):
            chunk = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.transport.broadcast(chunk)
            offset = 0
            for name, dtype, shape in metas:
                size = math.prod(shape) * dtype.itemsize
                view = chunk[offset : offset + size].view(dtype).view(shape)
                offset += size
                if name in self.weights and self.weights[name].shape == view.shape:
                    self.weights[name].copy_(view)
                else:
                    self.weights[name] = view.clone()
        self.chunks_received += 1
        if (
            self.fail_update_after_chunks is not None
            and self.chunks_received >= self.fail_update_after_chunks
        ):
            self._spend_fault()
            raise WorkerError(f"load_weights failed after chunk {self.chunks_received} (injected)")

    def _spend_fault(self) -> None:
        if self.fail_update_times is not None:
            self.fail_update_times -= 1
            if self.fail_update_times <= 0:
                self.fail_update_after_chunks = self.fail_update_times = None

    def raw_receive(self, body: dict) -> dict:
        """Benchmark baseline: `repeats` times, meet at a barrier, then receive plain broadcasts of `sizes`."""
        self._bind_device()
        if not self.receive:
            return {"received": 0}
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in body["sizes"]]
        for _ in range(int(body["repeats"])):
            self.transport.barrier()
            for buffer in buffers:
                self.transport.broadcast(buffer)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return {"received": len(buffers)}

    # -- LoRA (reads the adapter files the way a worker does)
    def load_adapter(self, body: dict) -> str:
        name, path = body["lora_name"], Path(body["lora_path"])
        if name in self.adapters and not body.get("load_inplace"):
            raise WorkerError(f"The lora adapter '{name}' has already been loaded.")
        config = json.loads((path / "adapter_config.json").read_text())
        if int(config["r"]) > int(self.lora.get("max_lora_rank", 0)):
            raise WorkerError(f"LoRA rank {config['r']} is greater than max_lora_rank")
        started = time.perf_counter()
        self.adapters[name] = self._read_adapter(name, path / "adapter_model.safetensors")
        self.lora_load_s.append(time.perf_counter() - started)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _read_adapter(self, name: str, file: Path) -> dict[str, torch.Tensor]:
        """vLLM 0.32's steps: each tensor read on the host and cast to the served dtype, pinned when a GPU
        serves (the pinned copies stay while the adapter is loaded, as in vLLM's CPU-side LoRA cache), then
        copied into the device's slots (here: one device tensor per name)."""
        self._bind_device()
        dtype, on_gpu = getattr(torch, self.dtype), self.device.type == "cuda"
        host = {}
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = f.get_tensor(key).to(dtype=dtype)
                host[key] = tensor.pin_memory() if on_gpu else tensor
        if not on_gpu:
            return host
        self.pinned[name] = host
        placed = {key: tensor.to(self.device, non_blocking=True) for key, tensor in host.items()}
        torch.cuda.synchronize(self.device)
        return placed

    def server_info(self) -> dict:
        lora = (
            {"max_lora_rank": self.lora["max_lora_rank"], "max_loras": self.lora["max_loras"]}
            if self.lora
            else None
        )
        config = {
            "model_config": {"dtype": f"torch.{self.dtype}"},
            "parallel_config": {"data_parallel_size": 1},
            "device_config": {"device": self.device.type},
            "weight_transfer_config": {"backend": "nccl"},
            "lora_config": lora,
        }
        return {"vllm_config": config, "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": bool(self.lora)}}

    def models(self) -> dict:
        base = [{"id": "stub-model", "root": "stub-model", "parent": None}]
        return {"data": base + [{"id": n, "root": n, "parent": "stub-model"} for n in self.adapters]}

    # -- routing
    def handle(self, method: str, path: str, query: dict, body: dict) -> tuple[int, object]:
        self.calls.append(path)
        route = ROUTES.get((method, path))
        if route is None:
            return HTTPStatus.NOT_FOUND, {"detail": "Not Found"}
        try:
            return HTTPStatus.OK, route(self, query, body)
        except WorkerError as error:
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(error)}

    def _start(self, query: dict, body: dict) -> dict:
        if self.state["started"]:
            raise WorkerError("start_weight_update called twice")
        if self.reject_start:
            raise WorkerError("start_weight_update rejected (injected)")
        self.state["started"] = True
        return {"message": "Weight update started"}

    def _finish(self, query: dict, body: dict) -> dict:
        if not self.state["started"]:
            raise WorkerError("finish_weight_update called without start_weight_update")
        self.state["started"] = False
        if body.get("weight_version") is not None:
            self.state["version"] = body["weight_version"]
        return {"message": "Weight update finished"}

    def _pause(self, query: dict, body: dict) -> dict:
        if query.get("mode", "abort") not in ("abort", "wait", "keep"):
            raise WorkerError(f"bad mode {query.get('mode')}")
        self.state["paused"] = True
        return {"status": "paused"}

    def _unload(self, query: dict, body: dict) -> str:
        if body["lora_name"] not in self.adapters:
            raise WorkerError(f"The lora adapter '{body['lora_name']}' cannot be found.")
        del self.adapters[body["lora_name"]]
        self.pinned.pop(body["lora_name"], None)
        return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."

    def serve(self, port: int = 0) -> LoopbackHTTP:
        """Serve on 127.0.0.1:`port` from a daemon thread; returns the server (`.port`, `.url`, `.stop()`:
        as a dead process, it then refuses connections and closes the kept-alive ones)."""

        def answer(method: str, path: str, raw: bytes) -> tuple[int, bytes]:
            url = urlparse(path)
            body = json.loads(raw) if raw else {}
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            status, payload = self.handle(method, url.path, query, body)
            return status, (payload if isinstance(payload, str) else json.dumps(payload)).encode()

        return LoopbackHTTP(answer, port)


ROUTES = {
    ("GET", "/health"): lambda w, q, b: {},
    ("GET", "/version"): lambda w, q, b: {"version": "0.32.0"},
    ("GET", "/v1/models"): lambda w, q, b: w.models(),
    ("GET", "/server_info"): lambda w, q, b: w.server_info(),
    ("GET", "/get_world_size"): lambda w, q, b: {"world_size": 1 if w.receive else 0},
    ("GET", "/is_paused"): lambda w, q, b: {"is_paused": w.state["paused"]},
    ("GET", "/weight_info"): lambda w, q, b: {"weight_version": w.state["version"]},
    ("POST", "/pause"): StubWorker._pause,
    ("POST", "/resume"): lambda w, q, b: w.state.update(paused=False) or {"status": "resumed"},
    ("POST", "/init_weight_transfer_engine"): lambda w, q, b: (
        w.init_engine(b["init_info"]) or {"message": "Weight transfer initialized"}
    ),
    ("POST", "/shutdown_weight_transfer_engine"): lambda w, q, b: {"message": "Weight transfer shut down"},
    ("POST", "/start_weight_update"): StubWorker._start,
    ("POST", "/update_weights"): lambda w, q, b: w.update(b["update_info"]) or {"message": "Weights updated"},
    ("POST", "/finish_weight_update"): StubWorker._finish,
    ("POST", "/v1/load_lora_adapter"): lambda w, q, b: w.load_adapter(b),
    ("POST", "/v1/unload_lora_adapter"): StubWorker._unload,
}


def checksums(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor float64 sums, to compare what arrived with what was sent."""
    return {name: float(t.double().sum()) for name, t in weights.items()}


ROUTES[("GET", "/bench/checksums")] = lambda w, q, b: checksums(w.weights)
ROUTES[("POST", "/bench/raw")] = lambda w, q, b: w.raw_receive(b)
ROUTES[("GET", "/bench/lora_loads")] = lambda w, q, b: {"seconds": w.lora_load_s}
ROUTES[("POST", "/bench/fault")] = lambda w, q, b: w.__dict__.update(b) or {}


def main() -> None:
    parser = argparse.ArgumentParser(description="A stub vLLM worker for weight-transfer benchmarks.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--transport", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--device", type=int, default=1, help="CUDA device of the receiver (nccl)")
    parser.add_argument("--max-lora-rank", type=int, default=0)
    parser.add_argument("--max-loras", type=int, default=0)
    parser.add_argument("--no-receiver", action="store_true", help="protocol only, world size 0 (one GPU)")
    args = parser.parse_args()
    if args.transport == "nccl":
        from agrpo_sync import NcclTransport

        torch.cuda.set_device(args.device)
        transport, device = NcclTransport(device_index=args.device), f"cuda:{args.device}"
    else:
        from tools.bench.weight_sync.gloo_transport import GlooTransport

        transport, device = GlooTransport(), "cpu"
    lora = {"max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras} if args.max_lora_rank else None
    worker = StubWorker(transport=transport, device=device, lora=lora)
    worker.receive = not args.no_receiver
    worker.serve(args.port)
    threading.Event().wait()


if __name__ == "__main__":
    main()
