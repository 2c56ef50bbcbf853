"""Concurrency goodput: fixed caps vs the adaptive rules, side by side (run `python -m tools.bench.concurrency`)."""
