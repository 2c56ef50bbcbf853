"""`tools/bench/train_step` runs on CPU with a tiny shape, so the GPU benchmark of the trainer's step never rots."""

from __future__ import annotations

import json
import sys

from tools.bench.train_step.__main__ import main


def test_the_train_step_bench_runs_tree_and_plain_steps_of_the_trainers_step_code(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["train_step", "--tiny", "--ratios", "1,8", "--checkpointing", "on",
                                      "--json", str(out)])  # fmt: skip
    main()
    results = json.loads(out.read_text())["results"]
    assert [(r["ratio"], r["checkpointing"]) for r in results] == [(1.0, "on"), (8.0, "on")]
    for r in results:
        for label in ("tree", "plain"):
            m = r[label]
            assert m["trained_tok_s"] > 0 and m["rows"] >= 1
            assert 0 < m["forward_s"] + m["head_s"] + m["backward_s"] + m["optimizer_s"] <= m["seconds"] * 1.05
        assert r["tree"]["trained_tokens"] == r["plain"]["trained_tokens"]  # the same samples, packed two ways
    assert results[1]["measured_ratio"] > 2  # ratio-8 groups share their prompts in tree rows
    assert "tree/plain MFU" in capsys.readouterr().out
