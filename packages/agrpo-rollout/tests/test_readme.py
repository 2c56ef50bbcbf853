"""The README's example runs against its own real CPU vLLM server and prints what it promises."""


def test_readme_example_generates_scored_samples(readme_example):
    last = readme_example.stdout.strip().splitlines()[-1]
    num_samples, fields = last.split(" ", 1)
    assert int(num_samples) > 0, readme_example.stdout
    assert "'input_ids'" in fields and "'trained_mask'" in fields and "'advantages'" in fields
