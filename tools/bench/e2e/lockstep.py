"""`LockstepRolloutLoop`: the rollout loop forced synchronous, for the end-to-end benchmark.

Owns one rule: within one policy version the loop starts new rollouts only until one optimizer step's worth
of samples (`samples_per_step`) has reached the trainer; then it waits until the server serves the next
version (the trainer trained on them and synced). So generate -> train -> sync alternate as in a
synchronous GRPO trainer, with every other part (client, packing, loss, sync) the same as in the async run
it is compared with. Counting samples, not groups, keeps it going when a group is dropped (all rewards
equal). Lives at module level: the loop is pickled into the spawned rollout process.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from agrpo_rollout import AsyncRolloutLoop
from agrpo_trainer import AsyncGRPOConfig, AsyncGRPOTrainer


@dataclass
class LockstepConfig(AsyncGRPOConfig):
    """`samples_per_step`: the samples one optimizer step consumes."""

    samples_per_step: int = 16


class LockstepRolloutLoop(AsyncRolloutLoop):
    async def run(self, sink, *, policy_version, **kwargs):
        self._served_version, self._lock = policy_version, threading.Lock()
        self._phase = [policy_version(), 0]  # [version, samples handed to the trainer under it]

        def counted(sample):  # runs in a worker thread (a plain sink)
            with self._lock:
                self._phase[1] += 1
            return sink(sample)

        return await super().run(counted, policy_version=policy_version, **kwargs)

    async def generate_one(self, prompt, tools, group_id=0):
        while True:
            with self._lock:
                if self._served_version() != self._phase[0]:
                    self._phase = [self._served_version(), 0]
                if self._phase[1] < self.config.samples_per_step:
                    break
            await asyncio.sleep(0.002)
        return await super().generate_one(prompt, tools, group_id)


class LockstepTrainer(AsyncGRPOTrainer):
    loop_cls = LockstepRolloutLoop
