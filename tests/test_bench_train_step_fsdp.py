"""`tools/bench/train_step/fsdp.py` runs on CPU (gloo, two ranks, tiny shape) with its weight sync, so the
two-GPU FSDP2 benchmark never rots: one GPU and two ranks train the same samples to the same loss curve, and
the sharded model's weights reach the stub receiver whole."""

from __future__ import annotations

from tools.bench.train_step.fsdp import main


def test_two_gloo_ranks_follow_the_one_rank_loss_curve_and_sync_their_sharded_weights(tmp_path, capsys):
    summary = main(["--tiny", "--world", "2", "--sync", "--json", str(tmp_path / "fsdp.json")])
    one, sharded = summary["one"], summary["sharded"]
    assert one["world"] == 1 and sharded["world"] == 2
    # the same samples, packed for one rank and for two
    assert one["trained_tokens"] == sharded["trained_tokens"]
    assert sharded["micro_batches"] < one["micro_batches"]  # two rows per micro-batch
    # the curve moves far more than the two runs differ, so matching it means something
    assert summary["loss_curve_moves"] > 20 * summary["loss_max_rel_diff"]
    assert summary["loss_within_tolerance"], (one["loss_curve"], sharded["loss_curve"])
    assert one["trained_tok_s_per_gpu"] > 0 and sharded["trained_tok_s_per_gpu"] > 0
    sync = sharded["sync"]
    assert sync["checksums_match"], sync["mismatched"]
    assert sync["bytes"] > 0 and sync["raw_s"] > 0 and sync["transfer_s"] > 0
    assert "weight sync from the FSDP2 model" in capsys.readouterr().out
