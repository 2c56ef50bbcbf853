"""Reads the history rows of an offline wandb run back from its `run-<id>.wandb` transaction log.

wandb 0.2x+ ships no Python reader (its core is a Go binary), and an offline run writes no summary file, so
this decodes the file itself: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of records, each a
7-byte header (crc32, little-endian length, kind: 1 full, 2 first, 3 middle, 4 last) and a chunk; a block's
tail shorter than a header is padding. Each record is a `wandb_internal_pb2.Record`; history items carry
JSON values.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7


def _records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a wandb transaction log"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER]) if left >= _HEADER else (0, 0, 0)
        if left < _HEADER or (length == 0 and kind == 0):
            pos += left
            continue
        chunk, pos = data[pos + _HEADER : pos + _HEADER + length], pos + _HEADER + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def read_history(run_dir: Path) -> list[dict]:
    """The run's logged rows, as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("*.wandb")
    rows = []
    for raw in _records(log.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return rows
