"""The README's example runs against its own real CPU vLLM server and reports the sync timings."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_syncs_twice_and_prints_timings():
    code = re.search(r"## Example.*?```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    lines = out.getvalue().strip().splitlines()[-2:]
    assert [line.split(" ", 1)[0] for line in lines] == ["1", "2"], out.getvalue()
    assert all("'perf/weight_sync_s'" in line and "'perf/weight_sync_transfer_s'" in line for line in lines)
