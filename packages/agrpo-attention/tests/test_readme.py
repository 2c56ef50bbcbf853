"""The README's example runs as written."""


def test_readme_example_runs(readme_example):
    names = readme_example.names
    assert names["logprobs"].shape == names["packed"].token_index.shape
