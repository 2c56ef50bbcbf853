"""The README's example runs and prints what it promises."""

from __future__ import annotations

import re


def test_readme_sft_example_runs_and_prints_the_packing_ratio(readme_example):
    ratio = float(re.search(r"packing ratio ([0-9.]+)", readme_example.stdout).group(1))
    assert ratio > 1.5, readme_example.stdout
    assert "rank 1:" in readme_example.stdout
