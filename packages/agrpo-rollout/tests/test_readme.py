"""The README's example runs against its own real CPU vLLM server and prints what it promises."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_generates_scored_samples():
    code = re.search(r"## Example.*?```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    last = out.getvalue().strip().splitlines()[-1]
    num_samples, fields = last.split(" ", 1)
    assert int(num_samples) > 0, out.getvalue()
    assert "'input_ids'" in fields and "'trained_mask'" in fields and "'advantages'" in fields
