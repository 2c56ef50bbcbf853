"""The README's example runs against its own real CPU vLLM server and reports the sync timings."""


def test_readme_example_syncs_twice_and_prints_timings(readme_example):
    lines = readme_example.stdout.strip().splitlines()[-2:]
    assert [line.split(" ", 1)[0] for line in lines] == ["1", "2"], readme_example.stdout
    assert all("'perf/weight_sync_s'" in line and "'perf/weight_sync_transfer_s'" in line for line in lines)
