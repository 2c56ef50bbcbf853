"""Every error agrpo-trainer raises on purpose, in one place.

    AsyncGRPOError                      base of the trainer's own errors
     ├── RolloutWorkerError             the rollout process raised, died or stopped answering
     ├── NothingTrainedError            the run goes on updating nothing: optimizer steps in a row had loss
     │                                  terms but none passed the IS mask, or groups in a row were all dropped
     └── ModelSetupError (ValueError)   a model/config combination the trainer cannot train

Configuration mistakes found at construction are plain `ValueError`s naming the field to change; objects
that cannot be pickled into the rollout process are `TypeError`s naming the object (SPEC F-PROC). Errors
of the four libraries (agrpo_sync.TransferFailedError, agrpo_rollout.ServerConfigError, ...) propagate
unchanged: their messages already say what to do.
"""

from __future__ import annotations


class AsyncGRPOError(Exception):
    """Base of agrpo-trainer's own errors."""


class RolloutWorkerError(AsyncGRPOError, RuntimeError):
    """The rollout process failed: its traceback, its exit code, or the seconds since its last heartbeat."""


class ModelSetupError(AsyncGRPOError, ValueError):
    """The model cannot be trained as configured (e.g. router_aux_loss_coef on a model without a router)."""


class NothingTrainedError(AsyncGRPOError, RuntimeError):
    """The run would go on updating nothing, so it stops and says what usually causes it: several optimizer
    steps in a row excluded every loss term (importance ratios outside the clip bounds, `EmptyStepGuard`), or
    `max_groups_dropped_in_a_row` groups in a row had equal or unscorable rewards, so no sample reached the
    trainer while the server kept generating (`DroppedGroupGuard`)."""
