"""The routing replay benchmark runs end to end on its tiny shape: three variants, each timed."""

from __future__ import annotations

import torch

from tools.bench.routing_replay import main


def test_the_bench_times_live_measured_and_replayed_steps(capsys):
    threads = torch.get_num_threads()
    try:
        medians = main(["--shape", "tiny", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    assert set(medians) == {"live", "measured", "replayed"} and all(ms > 0 for ms in medians.values())
    assert "x live" in capsys.readouterr().out
