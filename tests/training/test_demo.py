"""`specheads demo --quick`: data -> train -> benchmark end to end, outputs identical to plain greedy decoding."""

from __future__ import annotations

import json

import pytest

from specheads import load_heads
from specheads.cli import main

pytestmark = pytest.mark.slow


def test_quick_demo(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "plain greedy" in printed
    results = json.loads((out / "results.json").read_text())
    for key in ("tau", "speedup", "tokens_per_second", "baseline_tokens_per_second", "greedy_identical",
                "training_seconds", "features_seconds"):
        assert key in results, key
    assert results["greedy_identical"] is True
    assert results["tau"] >= 1.0 and results["total_seconds"] < 120
    heads = load_heads(out / "heads")
    assert heads.config.head_type == "eagle"
    assert (out / "features" / "index.json").exists()  # the heads trained on the dumped features (offline)
    assert json.loads((out / "train" / "run_config.json").read_text())["feature_mode"] == "offline"
