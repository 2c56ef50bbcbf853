"""The README's example trains three steps against its own real CPU vLLM server, and every push lands."""

import pytest


@pytest.mark.server
def test_readme_example_trains_and_every_sync_lands(readme_example):
    lines = readme_example.stdout.strip().splitlines()[-3:]
    assert [line.split()[0] for line in lines] == ["1", "2", "3"], readme_example.stdout
    assert all(float(line.split()[2]) < 1e-4 for line in lines)
