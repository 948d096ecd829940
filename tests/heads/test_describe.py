"""`specheads info`: a heads checkpoint described, and checked against a target."""

from __future__ import annotations

import json
import shutil

from transformers import LlamaConfig, LlamaForCausalLM

from specheads import create_heads
from specheads.cli import main
from specheads.heads.describe import describe_heads
from specheads.inference.custom_generate import write_custom_generate
from specheads.targets import ASSETS


def test_describe_eagle_and_medusa_heads(stories260k, tmp_path):
    eagle = create_heads(stories260k[0], "eagle")
    eagle.model_card_metrics = {"eval_sim_tau": 1.75}
    eagle.save_pretrained(tmp_path / "eagle")
    summary = describe_heads(tmp_path / "eagle")
    assert (summary["head_type"], summary["target"], summary["hidden_size"], summary["vocab_size"]) == (
        "eagle", "stories260K", 64, 512)
    assert summary["parameters"] == sum(p.numel() for p in eagle.parameters()) and summary["weights_mb"] > 0
    assert summary["tree"]["tree_depth"] == eagle.config.tree_depth and summary["metrics"] == {"eval_sim_tau": 1.75}
    assert summary["custom_generate"] is False and summary["target_adapter"] is None
    write_custom_generate(tmp_path / "eagle")
    assert describe_heads(tmp_path / "eagle")["custom_generate"] is True
    assert "cpu_tree" not in summary  # none: the same tree on every device
    create_heads(stories260k[0], "medusa", cpu_tree={"static_tree": "medusa_small"}).save_pretrained(tmp_path / "medusa")
    medusa = describe_heads(tmp_path / "medusa")
    assert medusa["num_heads"] >= 1 and "tree" not in medusa and medusa["cpu_tree"] == {"static_tree": "medusa_small"}
    assert "parallel_drafting" not in summary
    create_heads(stories260k[0], "eagle3", parallel_depth=5, parallel_slot_token=3).save_pretrained(tmp_path / "peagle")
    assert describe_heads(tmp_path / "peagle")["parallel_drafting"] == {"depth": 5, "slot_token": 3}


def test_info_command_checks_the_heads_against_a_target(stories260k, tmp_path, capsys):
    create_heads(stories260k[0], "eagle").save_pretrained(tmp_path / "heads")
    assert main(["info", str(tmp_path / "heads"), "--target", "stories260K"]) == 0
    assert json.loads(capsys.readouterr().out)["check"] == {"target": "stories260K", "compatible": True}
    other = tmp_path / "wider"  # stories260K's tokenizer on a target twice as wide
    shutil.copytree(ASSETS / "stories260K", other, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    config = LlamaConfig.from_pretrained(ASSETS / "stories260K")
    config.update(dict(hidden_size=128, intermediate_size=256))
    LlamaForCausalLM(config).save_pretrained(other)
    assert main(["info", str(tmp_path / "heads"), "--target", str(other)]) == 1
    check = json.loads(capsys.readouterr().out)["check"]
    assert not check["compatible"] and "hidden_size=64 but target" in check["reason"]
    (tmp_path / "empty").mkdir()
    assert main(["info", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    # another project's heads (not a draft model, though their config names a model_type): described as --heads reads
    # them, and checked on a target by converting them in memory
    from specheads.heads.interop import export_heads

    export_heads(tmp_path / "heads", "eagle", tmp_path / "foreign")
    assert main(["info", str(tmp_path / "foreign"), "--target", "stories260K"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["kind"], summary["format"], summary["head_type"], summary["hidden_size"]) == ("foreign", "eagle",
                                                                                                 "eagle", 64)
    assert summary["check"] == {"target": "stories260K", "compatible": True} and "--heads" in summary["use"]


def test_the_committed_cards_metrics_are_read():
    """Cards whose heading says more ("## Metrics (training, ...)") still give their metrics block."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle3"
    summary = describe_heads(folder)
    assert summary["head_type"] == "eagle3" and summary["draft_vocab_size"] == 8192
    assert 0 < summary["metrics"]["acc_depth1"] < 1


def test_card_base_model_is_a_hub_id_or_left_out():
    """The Hub links base_model only to Hub ids: aliases map to their repositories, local paths are left out."""
    from specheads.heads.base import hub_base_model

    assert hub_base_model("stories260K") == "karpathy/tinyllamas"
    assert hub_base_model("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_base_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub_base_model("/home/me/models/llama") is None and hub_base_model("./runs/x") is None
    assert hub_base_model("") is None


def test_saved_card_front_matter(stories260k, tmp_path):
    import yaml

    create_heads(stories260k[0], "eagle").save_pretrained(tmp_path / "h")
    front = (tmp_path / "h" / "README.md").read_text().split("---")[1]
    assert yaml.safe_load(front) == {"library_name": "specheads", "tags": ["speculative-decoding", "draft-heads", "eagle"],
                                     "base_model": "karpathy/tinyllamas"}


def test_custom_generate_of_a_hub_id_is_unknown_offline(stories260k, tmp_path, offline_hub_cache):
    """The Hub snapshot of heads holds no code files: offline, whether the repository has custom_generate is unknown."""
    create_heads(stories260k[0], "eagle").save_pretrained(tmp_path / "h")
    offline_hub_cache.publish(tmp_path / "h", "test-org/h")  # as downloaded: weights, config and card only
    assert describe_heads("test-org/h")["custom_generate"] is None
    assert describe_heads(tmp_path / "h")["custom_generate"] is False  # a local folder: known
