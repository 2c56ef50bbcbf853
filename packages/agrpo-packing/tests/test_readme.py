"""The README's example runs and prints what it promises."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_sft_example_runs_and_prints_the_packing_ratio():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    ratio = float(re.search(r"packing ratio ([0-9.]+)", out.getvalue()).group(1))
    assert ratio > 1.5, out.getvalue()
    assert "rank 1:" in out.getvalue()
