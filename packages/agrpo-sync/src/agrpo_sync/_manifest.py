"""`Manifest`: the names, shapes and dtypes of one version of the sent tensors, and the pre-flight check.

Owns what a sync is compared with before generation pauses: the server's own description of its weights
when `/weight_info` gives one (a mapping of names to shape and dtype; vLLM 0.32 and 0.33 report only
the version label), else the manifest of the first sync that succeeded in this process. A missing, an
extra or a misshapen tensor, or one whose dtype changed, is refused before anything is sent: vLLM's
reload only logs a warning for a missing tensor and then serves a mix of two versions, and a reload
with a tensor of another shape leaves that tensor in the server, which then fails every later reload
and crashes at the next forward (only a restart clears it). Before the first sync, when the directory
the server started from is visible, its safetensors headers give the shapes (names the two share are
compared; names and dtypes are not, since checkpoints may hold extra keys or another dtype). Does not
know how tensors are sent, pausing or ranks (`WeightSync` runs the check on the sending rank).

Cost: one pass over the stream's metadata (no gather, no copy), well under a millisecond for a
thousand tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ._wire_format import TensorMeta

_SHOWN = 8
"""Tensors named per kind of problem in an error message; the rest are counted."""

Entry = tuple[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one version holds: `tensors[name] = (dtype_name, shape)`, and where that knowledge came from."""

    tensors: dict[str, Entry]
    source: str
    """Says what the manifest describes, e.g. "the first sync (version 1)"."""
    complete: bool = True
    """False: only the shapes of the names both sides have are compared (a checkpoint's headers)."""

    @classmethod
    def of(cls, metas: Iterable[TensorMeta], source: str) -> Manifest:
        return cls({m.name: (m.dtype_name, tuple(m.shape)) for m in metas}, source)

    @classmethod
    def from_weight_info(cls, answer: Any) -> Manifest | None:
        """The server's tensors from a `/weight_info` answer listing them (`{"parameters": {name: {"shape":
        [...], "dtype": "..."}}}`, or under `"tensors"`); None when it lists none (vLLM 0.32/0.33)."""
        listed = (answer.get("parameters") or answer.get("tensors")) if isinstance(answer, dict) else None
        if not isinstance(listed, dict) or not listed:
            return None
        tensors = {
            str(name): (
                str(spec.get("dtype", "")).removeprefix("torch."),
                tuple(int(d) for d in spec["shape"]),
            )
            for name, spec in listed.items()
            if isinstance(spec, dict) and "shape" in spec
        }
        return cls(tensors, "the server's /weight_info") if tensors else None

    @classmethod
    def from_checkpoint(cls, directory: str) -> Manifest | None:
        """Shapes from the safetensors headers in `directory` (no tensor is read); None when there are none."""
        files = sorted(Path(directory).glob("*.safetensors")) if Path(directory).is_dir() else []
        tensors: dict[str, Entry] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    tensors[name] = ("", tuple(handle.get_slice(name).get_shape()))
        return cls(tensors, f"the server's checkpoint {directory}", complete=False) if tensors else None

    def problems(self, sent: Manifest) -> list[str]:
        """Why `sent` cannot replace what this manifest describes, one clause per kind (empty: it can)."""
        missing = sorted(set(self.tensors) - set(sent.tensors)) if self.complete else []
        extra = sorted(set(sent.tensors) - set(self.tensors)) if self.complete else []
        shapes, dtypes = [], []
        for name in sorted(set(self.tensors) & set(sent.tensors)):
            (want_dtype, want_shape), (dtype, shape) = self.tensors[name], sent.tensors[name]
            if shape != want_shape:
                shapes.append(f"{name} {list(shape)} (expected {list(want_shape)})")
            elif want_dtype and dtype != want_dtype:
                dtypes.append(f"{name} {dtype} (expected {want_dtype})")
        clauses = [
            ("missing", missing),
            ("not in " + self.source, extra),
            ("with another shape", shapes),
            ("with another dtype", dtypes),
        ]
        return [f"{len(items)} {kind}: {_listed(items)}" for kind, items in clauses if items]


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
