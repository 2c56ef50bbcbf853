"""Benchmark of tree packing against plain padding-free packing for a fwd+bwd step (see `__main__.py`)."""
