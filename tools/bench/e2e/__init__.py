"""End-to-end benchmark: async trainer vs the same pipeline forced synchronous (run `python -m tools.bench.e2e`)."""
