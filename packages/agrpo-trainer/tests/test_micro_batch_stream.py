"""MicroBatchStream: staleness drops on arrival and while waiting in the prefetch queue, packing on its own
thread (intervals recorded for the overlap metric), the tail flushed at the end of the stream."""

from __future__ import annotations

import dataclasses
import time

import pytest
from rollout_doubles import fixed_samples

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import PackingConfig
from agrpo_trainer._micro_batch_stream import MicroBatchStream
from agrpo_trainer._prompt_ledger import PromptLedger
from agrpo_trainer.testing import ReplaySource


@pytest.fixture(scope="module")
def samples():
    return fixed_samples(build_model(TinyModelSpec(), build_tokenizer()), num_prompts=4)


def _stream(samples, *, max_staleness=1, prefetch=4):
    source = ReplaySource(samples)
    source.start()
    packing = PackingConfig(token_budget=0, num_ranks=2, per_device_train_batch_size=2)
    return MicroBatchStream(source, packing, PromptLedger(), max_staleness=max_staleness, prefetch=prefetch)


def _drain(stream):
    batches = []
    while (batch := stream.next(0.05, on_wait=lambda: None)) is not None:
        batches.append(batch)
    return batches


def test_every_fresh_sample_arrives_packed_and_the_tail_is_flushed(samples):
    stream = _stream(samples)
    stream.start()
    batches = _drain(stream)
    assert sum(len(b.samples) for b in batches) == len(samples)
    assert all(len(b.rows) == 2 for b in batches)  # one row per rank
    stats = stream.take_stats()
    assert stats.dropped_stale == 0 and len(stats.pack_intervals) == len(batches)
    stream.stop()


def test_samples_older_than_max_staleness_are_dropped_on_arrival(samples):
    aged = [dataclasses.replace(s, policy_version=0 if i % 2 else 3) for i, s in enumerate(samples)]
    stream = _stream(aged, max_staleness=1)
    stream.policy_version = 3
    stream.start()
    kept = [s for b in _drain(stream) for s in b.samples]
    assert all(s.policy_version == 3 for s in kept) and len(kept) == len(samples) - len(samples) // 2
    assert stream.take_stats().dropped_stale == len(samples) // 2
    stream.stop()


def test_a_sync_while_batches_wait_in_the_prefetch_queue_removes_their_stale_samples(samples):
    fresh = [dataclasses.replace(s, policy_version=1) for s in samples]  # all fresh on arrival...
    stream = _stream(fresh, max_staleness=0, prefetch=64)
    stream.policy_version = 1
    stream.start()
    time.sleep(0.5)  # ...and packed into the prefetch queue
    stream.policy_version = 2  # then a sync: every waiting sample is one version too old
    assert stream.next(0.05, on_wait=lambda: None) is None
    assert stream.take_stats().dropped_stale == len(samples)
    stream.stop()
