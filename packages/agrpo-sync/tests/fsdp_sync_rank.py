"""One trainer rank of the FSDP2 weight-sync test (run twice, as ranks 0 and 1, by test_weight_sync.py).

Usage: python fsdp_sync_rank.py RANK DIST_PORT STUB_URL OUT_DIR. Shards the tiny Qwen3 with FSDP2 over
gloo, syncs it once to the stub worker, then with a fault that hits once (the re-send, in which both
ranks gather again, succeeds), then with a fault that hits every attempt, and writes what each rank saw
to OUT_DIR/rank<RANK>.json.
"""

import json
import os
import sys

import httpx
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_sync import TransferFailedError, WeightSync, WeightSyncConfig
from tools.bench.weight_sync.gloo_transport import GlooTransport


def sharded_model() -> torch.nn.Module:
    model = build_model(TinyModelSpec(), build_tokenizer())
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.5)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def main() -> None:
    rank, port, url, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = sharded_model()
    config = WeightSyncConfig(
        base_url=url, output_dir=out, gather_bucket_bytes=40_000, packed_buffer_size_bytes=30_000
    )
    sync = WeightSync.start(config, model, transport=GlooTransport(timeout_s=20) if rank == 0 else None)
    first = sync.sync(model, 1)
    result = {
        "num_bytes": first.num_bytes,
        "peak_gather_bytes": first.peak_gather_bytes,
        "has_backend": sync.backend is not None,
    }
    if rank == 0:
        httpx.post(f"{url}/bench/fault", json={"fail_update_after_chunks": 1, "fail_update_times": 1})
    result["second_retries"] = sync.sync(model, 2).retries
    if rank == 0:
        httpx.post(f"{url}/bench/fault", json={"fail_update_after_chunks": 1, "fail_update_times": None})
    try:
        sync.sync(model, 3)
        result["third"] = "ok"
    except TransferFailedError as error:
        result["third"] = str(error)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
