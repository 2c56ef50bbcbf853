"""Weight-sync benchmark: agrpo-sync's NCCL path side by side with a raw NCCL broadcast of the same bytes.

Owns the measurement: a Qwen3-4B-shaped bf16 model (random weights, about 8 GB) on GPU0 as the trainer,
a stub worker (`stub_worker.py`: the worker side of vLLM's packed NCCL protocol plus a tiny HTTP server
standing in for the real server's pause/start/update/finish/resume endpoints; the GPU machine has no
vLLM) on GPU1, then:
  * raw:  the same chunk sizes broadcast from preallocated buffers (no packing, no HTTP);
  * ours: `WeightSync.sync` end to end (pause, gather, pack, broadcast, receiver copies into its weights,
          finish, resume), checked afterwards by per-tensor checksums on the receiver;
  * lora: adapter-only sync of a rank-32 LoRA on every linear layer (write safetensors, the stub loads them
          the way vLLM's worker does), for each file dtype and directory asked for, split into its parts
          (the backend's `last_send`: gather + host copy, file write, the server's load, the retire of the
          version leaving the window; the stub's own load time beside it), and the last file read back and
          compared with the model. `--lora-staging pageable` swaps in the per-tensor pageable copy that the
          pinned staging replaced, to measure the two side by side (one process each: the first case is cold).
Does not know agrpo-sync's internals beyond its public API, except the LoRA backend's timing and staging.

Run on two GPUs: `NCCL_NVLS_ENABLE=0 python -m tools.bench.weight_sync [--json out.json]`.
Adapter only, one GPU: `python -m tools.bench.weight_sync --lora-only --single-gpu --lora-dtypes float32,bfloat16
--lora-dirs tmp,/dev/shm`. Dry run on CPU (gloo instead of NCCL, tiny model): `uv run python -m
tools.bench.weight_sync --transport gloo --model tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from agrpo_sync import WeightSync, WeightSyncConfig, plan_chunks
from agrpo_sync._background_call import BackgroundCall
from agrpo_sync._checkpoint_dir import host_copy
from agrpo_sync._nccl_transport import find_nccl_library

ROOT = Path(__file__).resolve().parents[3]
SHAPES = {
    "qwen3-4b": dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    ),
    "tiny": dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    ),
}  # fmt: skip
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    """A randomly initialised Qwen3 causal LM of the named shape, bf16, tied embeddings (like Qwen3-4B)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def start_stub(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tools.bench.weight_sync.stub_worker", "--port", str(port)]
    command += ["--transport", args.transport, "--device", "0" if args.single_gpu else "1"]
    command += ["--max-lora-rank", "32", "--max-loras", "6"] + (["--no-receiver"] if args.single_gpu else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            httpx.get(f"{url}/health", timeout=1)
            return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the stub worker did not start")


def sender_transport(args: argparse.Namespace):
    if args.transport == "gloo":
        from tools.bench.weight_sync.gloo_transport import GlooTransport

        return GlooTransport(timeout_s=120)
    from agrpo_sync import NcclTransport

    return NcclTransport(device_index=0, num_slots=args.num_buffers)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ours(args, model, url, transport, out_dir: str) -> tuple[dict, list[int]]:
    config = WeightSyncConfig(
        base_url=url,
        output_dir=out_dir,
        packed_buffer_size_bytes=args.buffer_mib << 20,
        packed_num_buffers=args.num_buffers,
    )
    sync = WeightSync.start(config, model, transport=transport)
    sync.sync(model, 0)  # warm-up: first-time allocations on both sides
    timings = [sync.sync(model, version) for version in range(1, args.iters + 1)]
    received = httpx.get(f"{url}/bench/checksums", timeout=600).json()
    sent = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
    mismatched = [n for n in sent if abs(sent[n] - received.get(n, float("nan"))) > 1e-6 * (1 + abs(sent[n]))]
    if args.single_gpu:  # nothing was received
        mismatched, received = ["(single GPU: no receiver)"], sent
    sizes = [plan.nbytes for plan in plan_chunks(sync.param_stream(model).metadata(), args.buffer_mib << 20)]

    def median(field: str) -> float:
        return statistics.median(getattr(t, field) for t in timings)

    result = {
        "bytes": timings[0].num_bytes,
        "chunks": len(sizes),
        "transfer_s": median("transfer_s"),
        "pause_total_s": median("weight_sync_s"),
        "pause_total_max_s": max(t.weight_sync_s for t in timings),
        "pause_s": median("pause_s"),
        "barrier_s": median("barrier_s"),
        "checksums_match": not mismatched and len(received) == len(sent),
        "single_gpu": bool(args.single_gpu),
        "mismatched": mismatched[:5],
    }
    return result, sizes


def bench_raw(args, url, transport, sizes: list[int], device: torch.device) -> dict:
    """The same chunk sizes, broadcast from preallocated buffers between two barriers."""
    receiver = BackgroundCall(
        lambda: httpx.post(
            f"{url}/bench/raw", json={"sizes": sizes, "repeats": args.iters}, timeout=600
        ).raise_for_status()
    ).start()
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    times = []
    for _ in range(args.iters):
        transport.barrier()
        begin = time.perf_counter()
        for buffer in buffers:
            transport.broadcast(buffer)
        synchronize(device)
        times.append(time.perf_counter() - begin)
    receiver.wait(600)
    return {"transfer_s": statistics.median(times), "min_s": min(times)}


class PageableStaging:
    """The adapter's host copy before pinned staging: one blocking copy into fresh pageable memory per tensor
    (`--lora-staging pageable`, the baseline the pinned buffers are measured against)."""

    def reserve(self, metas, dtype=None) -> None:
        """Nothing is kept from one write to the next."""

    def copy(self, tensors, dtype=None) -> dict:
        return host_copy([(n, t.to(dtype) if dtype is not None else t) for n, t in tensors])


def _lora_model(args, model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=LORA_TARGETS)
    )


def _lora_case(args, peft_model, url, out_dir: str, dtype: str) -> dict:
    """`args.iters` adapter versions through `WeightSync`, each split into its parts."""
    config = WeightSyncConfig(
        base_url=url, output_dir=out_dir, lora_sync="adapter", max_staleness=4, transfer_dtype=dtype
    )
    sync = WeightSync.start(config, peft_model)
    if args.lora_staging == "pageable":
        sync.backend._staging = PageableStaging()
    loads_before = len(httpx.get(f"{url}/bench/lora_loads", timeout=60).json()["seconds"])
    timings, parts = [], []
    for version in range(1, args.iters + 1):
        timings.append(sync.sync(peft_model, version))
        parts.append(sync.backend.last_send)
    file_dtype = dtype or str(sync.backend.file_dtype or "").removeprefix("torch.")
    last_file = sync.backend.path(args.iters) / "adapter_model.safetensors"
    file_bytes = last_file.stat().st_size
    mismatched = _adapter_file_mismatches(sync.backend.path(args.iters), peft_model, file_dtype)
    sync.close()
    server_loads = httpx.get(f"{url}/bench/lora_loads", timeout=60).json()["seconds"][loads_before:]
    totals = [t.weight_sync_s for t in timings]
    out = {
        "dtype": f"{dtype or 'auto'} ({file_dtype or 'float32'} files)", "dir": out_dir, "staging": args.lora_staging, "bytes": file_bytes,
        "sync_s": statistics.median(totals), "sync_max_s": max(totals), "first_s": totals[0],
        "server_load_s": statistics.median(server_loads), "server_load_max_s": max(server_loads),
        "file_matches_model": not mismatched, "mismatched": mismatched[:3],
        "per_version_ms": [round(t * 1e3, 1) for t in totals], "server_load_ms": [round(t * 1e3, 1) for t in server_loads],
        "write_ms": [round(p.write_s * 1e3, 1) for p in parts],
    }  # fmt: skip
    for field in ("copy_s", "write_s", "load_s", "retire_s"):
        out[field] = statistics.median(getattr(p, field) for p in parts)
        out[field.replace("_s", "_max_s")] = max(getattr(p, field) for p in parts)
    return out


def _adapter_file_mismatches(directory: Path, peft_model, dtype: str) -> list[str]:
    """Names whose tensor in the last written adapter file differs from the model's (after the dtype cast)."""
    from safetensors.torch import load_file

    from agrpo_sync._lora_weights import adapter_entries

    written = load_file(str(directory / "adapter_model.safetensors"))
    cast = getattr(torch, dtype) if dtype else None
    bad = []
    for entry in adapter_entries(peft_model, cast):
        expected = entry.sources[0].detach().to(entry.meta.dtype).cpu()
        if entry.meta.name not in written or not torch.equal(written[entry.meta.name], expected):
            bad.append(entry.meta.name)
    return bad


def bench_lora(args, model, url) -> list[dict]:
    """Adapter-only sync for every `--lora-dtypes` x `--lora-dirs` case, in that order (the first is cold)."""
    peft_model = _lora_model(args, model)
    cases = []
    for place in args.lora_dirs.split(","):
        for dtype in args.lora_dtypes.split(","):
            with tempfile.TemporaryDirectory(dir=None if place == "tmp" else place) as base:
                cases.append(_lora_case(args, peft_model, url, base, "" if dtype == "auto" else dtype))
    return cases


def hardware(args, transport) -> str:
    if args.transport == "gloo" or transport is None:
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        return f"CPU only ({platform.machine()}, {os.cpu_count()} cores), gloo stand-in for NCCL, torch {torch.__version__}"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    version = transport.library.version()
    return f"{len(names)}x {names[0]}, torch {torch.__version__}, NCCL {version} ({find_nccl_library(transport.library_path)})"


def _ms(case: dict, part: str) -> str:
    return f"{case[part + '_s'] * 1e3:.0f}/{case[part + '_max_s'] * 1e3:.0f}"


def _full_lines(results: dict) -> list[str]:
    ours, raw = results["ours"], results["raw"]
    gb = ours["bytes"] / 1e9
    return [
        f"state dict: {results['model']} shapes, bf16, {gb:.2f} GB in {ours['chunks']} packed chunks "
        f"(buffer {results['buffer_mib']} MiB, {results['num_buffers']} in flight), {results['iters']} timed syncs",
        f"raw NCCL broadcast, same chunks:   {raw['transfer_s'] * 1e3:8.1f} ms  ({gb / raw['transfer_s']:6.0f} GB/s)",
        f"agrpo-sync transfer (start..finish): {ours['transfer_s'] * 1e3:8.1f} ms  ({gb / ours['transfer_s']:6.0f} GB/s)"
        f"  ratio {ours['transfer_s'] / raw['transfer_s']:.2f}x  (target <= 1.5x)",
        f"trainer-visible pause (pause..resume): median {ours['pause_total_s'] * 1e3:.1f} ms, max "
        f"{ours['pause_total_max_s'] * 1e3:.1f} ms (target < 250 ms); of which /pause {ours['pause_s'] * 1e3:.1f} ms, "
        f"barrier {ours['barrier_s'] * 1e3:.2f} ms",
        f"receiver checksums match the sender: {ours['checksums_match']} {ours['mismatched'] or ''}",
    ]


def report(results: dict) -> None:
    lines = [f"hardware: {results['hardware']}"] + (_full_lines(results) if results.get("ours") else [])
    for case in results.get("lora") or []:
        lines.append(
            f"LoRA r={results['lora_rank']} adapter sync, {case['dtype']} ({case['bytes'] / 1e6:.0f} MB), "
            f"{case['staging']} staging, files under {case['dir']}: median {case['sync_s'] * 1e3:.0f} ms, max "
            f"{case['sync_max_s'] * 1e3:.0f} ms (first {case['first_s'] * 1e3:.0f} ms); parts median/max ms: copy "
            f"{_ms(case, 'copy')}, write {_ms(case, 'write')}, load {_ms(case, 'load')} (the stub's own load "
            f"{_ms(case, 'server_load')}), retire {_ms(case, 'retire')}; file matches the model: "
            f"{case['file_matches_model']}\n    per version ms: {case['per_version_ms']}\n    of which the stub's load: "
            f"{case['server_load_ms']}\n    and the write: {case['write_ms']}"
        )
    print("\n".join(lines), flush=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="agrpo-sync NCCL weight sync vs a raw NCCL broadcast.")
    parser.add_argument("--transport", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--buffer-mib", type=int, default=1024, help="packed_buffer_size_bytes, in MiB")
    parser.add_argument("--num-buffers", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=32, help="0 skips the adapter benchmark")
    parser.add_argument("--lora-only", action="store_true", help="skip the full-weight sync (no NCCL group)")
    parser.add_argument(
        "--lora-dtypes", default="auto",
        help="comma list of transfer_dtype values: auto (transfer_dtype='', files in the server's dtype), "
        "float32 (what PEFT keeps), bfloat16",
    )  # fmt: skip
    parser.add_argument(
        "--lora-dirs", default="tmp", help="comma list: tmp (a temporary dir) and/or parent dirs"
    )
    parser.add_argument("--lora-staging", choices=["pinned", "pageable"], default="pinned",
                        help="pinned: agrpo-sync's reused pinned buffers; pageable: the per-tensor copy before them")  # fmt: skip
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--single-gpu", action="store_true",
        help="one GPU: the stub joins no NCCL group (world size 1), so this measures agrpo-sync's own overhead "
        "(HTTP, packing, streams) around a broadcast that moves nothing",
    )  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    device = torch.device("cuda", 0) if args.transport == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    process, url = start_stub(args)
    try:
        model = build_model(args.model, device)
        transport = None if args.lora_only else sender_transport(args)
        ours = raw = lora = None
        with tempfile.TemporaryDirectory() as out_dir:
            if not args.lora_only:
                ours, sizes = bench_ours(args, model, url, transport, out_dir)
                raw = bench_raw(args, url, transport, sizes, device)
            lora = bench_lora(args, model, url) if args.lora_rank else None
        results = {
            "hardware": hardware(args, transport), "model": args.model, "iters": args.iters, "lora_rank": args.lora_rank,
            "buffer_mib": args.buffer_mib, "num_buffers": args.num_buffers, "ours": ours, "raw": raw, "lora": lora,
        }  # fmt: skip
        report(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        process.kill()


if __name__ == "__main__":
    main()
