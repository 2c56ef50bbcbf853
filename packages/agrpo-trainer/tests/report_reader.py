"""Reads a run report back: the curves plotly was given, by trace name, from the page's `Plotly.newPlot` call.

Used by the report tests (a report written from a made-up history, and the one a real run wrote). Decodes
plotly's typed arrays (`{"dtype": "f8", "bdata": base64}`), which newer plotly versions write for numbers.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np


def _values(data) -> list[float]:
    if isinstance(data, dict) and "bdata" in data:
        return np.frombuffer(base64.b64decode(data["bdata"]), dtype=np.dtype(data["dtype"])).tolist()
    return list(data)


def read_curves(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    """{trace name: (x, y)} of the report's figure."""
    page = path.read_text()
    call = re.search(r'Plotly\.newPlot\(\s*"agrpo-report",\s*', page)
    assert call, "the report has no plotly figure"
    traces, _ = json.JSONDecoder().raw_decode(page, call.end())
    return {t["name"]: (_values(t["x"]), _values(t["y"])) for t in traces}
