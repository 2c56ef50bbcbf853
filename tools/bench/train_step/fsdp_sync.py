"""Weight sync from the FSDP2-sharded trainer of `fsdp.py --sync` to the stub receiver, against the raw
NCCL broadcast of the same chunks.

Owns that part of the run: rank 0 starts the stub worker (`tools/bench/weight_sync/stub_worker.py`) on GPU 1
(which the trainer's rank 1 shares; no step runs during a sync) and shares its URL; every rank calls
`WeightSync.start` and `sync`, since the bucketed FSDP2 gathers are collectives, and rank 0 sends (fp32
master weights cast to the stub's bf16 on the wire, `transfer_dtype="bfloat16"`). Then rank 0 broadcasts
the same chunk sizes from preallocated buffers through the same communicator (`bench_raw` of the
weight-sync benchmark) while the other ranks wait, and the receiver's per-tensor checksums are compared
with the full weights cast to the wire dtype. On CPU (`--tiny`) gloo stands in for NCCL on both sides.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import httpx
import torch
import torch.distributed as dist

from agrpo_sync import WeightSync, WeightSyncConfig, plan_chunks
from agrpo_sync._param_stream import full_tensor
from tools.bench.weight_sync.__main__ import bench_raw, sender_transport, start_stub


@torch.no_grad()
def _checksums(model: torch.nn.Module) -> dict[str, float]:
    """Per-tensor float64 sums of the full weights as the wire carries them (every rank joins each gather)."""
    return {n: float(full_tensor(p).to(torch.bfloat16).double().sum()) for n, p in model.named_parameters()}


def _url(stub_args: argparse.Namespace, rank: int):
    process, url = start_stub(stub_args) if rank == 0 else (None, None)
    box = [url]
    dist.broadcast_object_list(box, src=0)
    return process, box[0]


def sync_from_sharded(model: torch.nn.Module, rank: int, world: int, args) -> dict:
    """Rank 0's numbers of `--sync-iters` timed syncs after a warm-up, and of the raw broadcast ({} elsewhere)."""
    cuda = args.device == "cuda"
    stub_args = argparse.Namespace(
        transport="nccl" if cuda else "gloo", single_gpu=False, num_buffers=2, iters=args.sync_iters
    )
    process, url = _url(stub_args, rank)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            config = WeightSyncConfig(base_url=url, output_dir=out_dir, transfer_dtype="bfloat16")
            transport = sender_transport(stub_args) if rank == 0 else None
            sync = WeightSync.start(config, model, transport=transport)
            sync.sync(model, 0)  # warm-up: first-time allocations on both sides
            timings = [sync.sync(model, version) for version in range(1, args.sync_iters + 1)]
            sent = _checksums(model)
            result = {}
            if rank == 0:
                metadata = sync.param_stream(model).metadata()
                sizes = [p.nbytes for p in plan_chunks(metadata, config.packed_buffer_size_bytes)]
                device = torch.device("cuda", 0) if cuda else torch.device("cpu")
                raw = bench_raw(stub_args, url, transport, sizes, device)
                received = httpx.get(f"{url}/bench/checksums", timeout=600).json()
                bad = [
                    n
                    for n in sent
                    if abs(sent[n] - received.get(n, float("nan"))) > 1e-6 * (1 + abs(sent[n]))
                ]
                result = {
                    "bytes": timings[0].num_bytes, "chunks": len(sizes), "raw_s": raw["transfer_s"],
                    "transfer_s": statistics.median(t.transfer_s for t in timings),
                    "sync_s": statistics.median(t.weight_sync_s for t in timings),
                    "peak_gather_bytes": max(t.peak_gather_bytes for t in timings),
                    "checksums_match": not bad and len(received) == len(sent), "mismatched": bad[:5],
                }  # fmt: skip
            dist.barrier()
            sync.close()
        return result
    finally:
        if process is not None:
            process.kill()
