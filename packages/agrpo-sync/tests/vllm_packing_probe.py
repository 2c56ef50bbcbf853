"""Runs vLLM's own packing code on CPU for the wire-compatibility test (executed with the vLLM env's Python).

Input (torch.save): {"tensors": [(name, tensor)], "cases": [{"buffer_size": int, "chunks": [uint8 tensors]}]}.
For each case: the chunks vLLM's `packed_nccl_broadcast_producer` broadcasts for `tensors`, and what its
`packed_nccl_broadcast_consumer` requests and unpacks when fed the given chunks. CUDA streams are
replaced by no-ops (CPU has none); the packing and unpacking code is vLLM's, unchanged.
"""

import contextlib
import sys

import torch
from vllm.distributed.weight_transfer import packed_tensor


class _NoStream:
    def synchronize(self) -> None:
        pass


packed_tensor._get_streams = lambda device, num: tuple(_NoStream() for _ in range(num))
torch.accelerator.current_device_index = lambda: 0
torch.cuda.stream = lambda stream: contextlib.nullcontext()


class _Producer:
    def __init__(self) -> None:
        self.chunks = []

    def broadcast(self, tensor, src):
        self.chunks.append(tensor.clone())


class _Consumer:
    def __init__(self, chunks) -> None:
        self.chunks = list(chunks)
        self.sizes = []

    def broadcast(self, tensor, src):
        self.sizes.append(tensor.numel())
        chunk = self.chunks.pop(0)
        assert chunk.numel() == tensor.numel(), (chunk.numel(), tensor.numel())
        tensor.copy_(chunk)


def run_case(tensors, case):
    producer = _Producer()
    packed_tensor.packed_nccl_broadcast_producer(
        iter(tensors), producer, 0, lambda item: item[1], case["buffer_size"], 2
    )
    consumer, loaded = _Consumer(case["chunks"]), []
    metadata = ((name, (list(t.shape), t.dtype)) for name, t in tensors)
    packed_tensor.packed_nccl_broadcast_consumer(
        metadata, consumer, 0, lambda pairs: loaded.extend((n, t.clone()) for n, t in pairs),
        case["buffer_size"], 2, device="cpu",
    )  # fmt: skip
    return {"vllm_chunks": producer.chunks, "consumer_sizes": consumer.sizes, "loaded": loaded}


if __name__ == "__main__":
    data = torch.load(sys.argv[1])
    torch.save([run_case(data["tensors"], case) for case in data["cases"]], sys.argv[2])
