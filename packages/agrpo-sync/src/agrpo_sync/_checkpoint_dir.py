"""Writing a directory of safetensors atomically, for servers that read weights from disk.

Owns host copies of gathered tensors (safetensors refuses tensors that share storage), sharded or
single-file layouts (sharded: one file per gather bucket plus `model.safetensors.index.json`), and the
publish step: everything is written under `<dir>.partial` and renamed into place only when complete,
so the server never reads a half-written version. `HostStaging` keeps the host memory of a set of
tensors written again and again (adapter versions): pinned buffers filled by non-blocking copies with
one wait, instead of a blocking copy into fresh pageable memory per tensor. A write that fails (disk
full, file too large, read-only; safetensors raises its own `SafetensorError`, not `OSError`) removes
its `.partial` directory and raises `CheckpointWriteError` naming the directory and the cause. Also owns
`fresh_directory`: a name beside a directory still in use, so a version written twice never overwrites
the files a server may still read. Does not know what the files are for (full weights or a LoRA
adapter) or the server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ._wire_format import TensorMeta

INDEX_FILE = "model.safetensors.index.json"

WRITE_ERRORS = (OSError, SafetensorError)
"""What a failed write raises: I/O errors, and safetensors' own error type (e.g. "No space left on device")."""


class CheckpointWriteError(OSError):
    """A checkpoint directory could not be written; nothing was published and no `.partial` is left."""


Bucket = list[tuple[str, torch.Tensor]]


def host_copy(tensors: Bucket) -> dict[str, torch.Tensor]:
    """CPU tensors by name, each owning its memory."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors:
        host = tensor.detach().to("cpu").contiguous()
        pointer = host.untyped_storage().data_ptr()
        out[name] = host.clone() if pointer in seen else host
        seen.add(pointer)
    return out


class HostStaging:
    """Host copies of GPU tensors in pinned buffers kept from one write to the next (one per tensor name).

    The copies are issued non-blocking on each device's current stream and waited for once, so a write of
    hundreds of small tensors (a 36-layer adapter has 504) costs one device round trip rather than one per
    tensor; tensors already on the host are used as they are (`host_copy`). Each buffer is its own
    allocation, so safetensors (which refuses tensors sharing storage) takes them directly.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def reserve(self, metas: Iterable[TensorMeta], dtype: torch.dtype | None = None) -> None:
        """Allocate the pinned buffers ahead (at start-up), so the first write does not pay for them."""
        for meta in metas:
            cast = dtype if dtype is not None and meta.dtype.is_floating_point else meta.dtype
            self._buffer(meta.name, meta.shape, cast)

    def copy(
        self, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """CPU tensors by name, floating-point ones cast to `dtype` when given (on the device, before the
        copy); GPU tensors land in this staging's buffers, valid until the next `copy`."""
        out: dict[str, torch.Tensor] = {}
        on_host: Bucket = []
        streams = {}
        for name, tensor in tensors:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            if tensor.device.type != "cuda":
                on_host.append((name, tensor))
                continue
            buffer = self._buffer(name, tuple(tensor.shape), tensor.dtype)
            buffer.copy_(tensor.detach(), non_blocking=True)
            streams[tensor.device] = torch.cuda.current_stream(tensor.device)
            out[name] = buffer
        for stream in streams.values():
            stream.synchronize()
        out.update(host_copy(on_host))
        return out

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[name] = buffer
        return buffer


def _write_shards(buckets: Iterable[Bucket], directory: Path) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for index, bucket in enumerate(buckets):
        file_name = f"model-{index + 1:05d}.safetensors"
        tensors = host_copy(bucket)
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        total += sum(t.nbytes for t in tensors.values())
    index_body = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index_body, indent=1))


def write_checkpoint(
    buckets: Iterable[Bucket],
    directory: Path,
    *,
    single_file: str = "",
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write `buckets` into `directory` (replacing it): shards plus index, or all in `single_file`.

    `extra_files(partial_dir)` adds files such as `adapter_config.json` before the directory is published.
    Raises `CheckpointWriteError` when writing fails; the partial directory is removed first.
    """
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        if single_file:
            tensors = {name: t for bucket in buckets for name, t in host_copy(bucket).items()}
            save_file(tensors, str(partial / single_file), metadata={"format": "pt"})
        else:
            _write_shards(buckets, partial)
        if extra_files is not None:
            extra_files(partial)
    except WRITE_ERRORS as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(f"writing {directory} failed: {type(error).__name__}: {error}") from error
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory


def fresh_directory(directory: Path, in_use: set[Path]) -> Path:
    """`directory`, or `<directory>.1`, `.2`, ... : the first of these that is not `in_use`."""
    candidate, index = directory, 0
    while candidate in in_use:
        index += 1
        candidate = directory.with_name(f"{directory.name}.{index}")
    return candidate
