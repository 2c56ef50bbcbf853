"""`PackingConfig`: the one settings object of agrpo-packing.

Owns validation and the resolution of `token_budget=None` to the server's `max_model_len`. Does not
know the server (the trainer passes `max_model_len` in) nor the planner's algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class PackingConfig:
    """How a stream of samples becomes micro-batches of rows (SPEC F-PACK)."""

    token_budget: int | None
    """Unique tokens (and, separately, loss terms) per row; None = `max_model_len`; <= 0 = fixed-count mode."""
    num_ranks: int = 1
    """Rows per micro-batch: one per data-parallel rank (>= 1)."""
    max_model_len: int | None = None
    """Tokens; the server's context length, the budget when `token_budget` is None."""
    per_device_train_batch_size: int = 1
    """Samples per rank per micro-batch in fixed-count mode (>= 1); unused under a token budget."""
    share_prefixes: bool = True
    """False = plain mode: padding-free varlen rows, common prefixes forwarded once per sample."""

    def __post_init__(self) -> None:
        if self.token_budget is None and self.max_model_len is None:
            raise ValueError(
                "token_budget=None means the server's max_model_len, but max_model_len is None: pass "
                "max_model_len=..., set token_budget to a token count, or token_budget=0 for fixed-count mode"
            )
        for name in ("num_ranks", "per_device_train_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def resolved_budget(self) -> int:
        """The token budget in force; <= 0 means fixed-count mode."""
        return int(self.max_model_len if self.token_budget is None else self.token_budget)

    @property
    def fixed_count(self) -> bool:
        return self.resolved_budget <= 0

    @property
    def samples_per_micro_batch(self) -> int:
        """Fixed-count mode: `per_device_train_batch_size * num_ranks`."""
        return self.per_device_train_batch_size * self.num_ranks
