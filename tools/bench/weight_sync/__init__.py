"""Weight-sync benchmark and its protocol-level stand-ins (a gloo transport, a stub vLLM worker)."""
