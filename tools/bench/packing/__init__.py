"""CPU benchmark of agrpo-packing's planner and collator; run `python -m tools.bench.packing`."""
