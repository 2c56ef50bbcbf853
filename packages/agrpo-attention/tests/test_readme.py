"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_example_runs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["logprobs"].shape == namespace["packed"].token_index.shape
