"""`specheads export --format mtp`: fine-tuned MTP heads written back into their target's model folder, read back by
transformers' own MTP loader (heads/checkpoint_mtp.py for Qwen3-Next, Qwen3.5, GLM-4.7-Flash) as the same layer."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads import create_heads
from specheads.cli import main
from specheads.heads.mtp_export import export_mtp_into_target

from ..mtp_targets import (
    CHECKPOINT_MTP_FAMILIES,
    MTP_FAMILIES,
    QWEN_MTP_FAMILIES,
    load_mtp_target,
    write_mtp_target,
)

IDS, POSITIONS = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
MASK = torch.full((1, 1, 4, 4), torch.finfo(torch.float32).min).triu(1)


def fine_tuned(target):
    """The target's MTP heads with every weight moved (as a fine-tuning run would)."""
    heads = create_heads(target, "mtp")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    return heads


def draft_logits(heads, features):
    with torch.no_grad():
        return heads.logits(heads(features, IDS, POSITIONS, MASK))


# the model.layers.N layout (GLM-4.7-Flash's read by heads/checkpoint_mtp.py), and the mtp.* one (Mellum's, read by
# transformers; Qwen's, by heads/checkpoint_mtp.py)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "mellum", "qwen3_next", "qwen3_5_text"])
def test_exported_mtp_heads_are_the_targets_mtp_layer_when_reloaded(tmp_path, family):
    folder = write_mtp_target(tmp_path / "target", family)
    heads = fine_tuned(load_mtp_target(folder))
    heads.save_pretrained(tmp_path / "heads")
    out = tmp_path / "exported"
    assert main(["export", "--heads", str(tmp_path / "heads"), "--format", "mtp", "--out", str(out)]) == 0
    reloaded = create_heads(load_mtp_target(out), "mtp")  # transformers' MtpModel reads the folder's MTP layer
    features = torch.randn(1, 4, 64)
    assert torch.equal(draft_logits(reloaded, features), draft_logits(heads, features))
    assert not (out / "model.safetensors").is_symlink() and (out / "config.json").is_symlink()
    original, written = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(original) == set(written)
    layers = {**MTP_FAMILIES, **CHECKPOINT_MTP_FAMILIES}[family][0]
    prefix = "mtp." if family in ("mellum", *QWEN_MTP_FAMILIES) else f"model.layers.{layers}."
    changed = {name for name in original if not torch.equal(original[name], written[name])}
    assert changed and all(name.startswith(prefix) for name in changed)  # the MTP layer only


def test_export_refuses_what_it_cannot_write(tmp_path, tiny_target_factory):
    folder = write_mtp_target(tmp_path / "target", "deepseek_v3")
    heads = fine_tuned(load_mtp_target(folder))
    with pytest.raises(ValueError, match="head_type='eagle', expected 'mtp'"):
        export_mtp_into_target(create_heads(tiny_target_factory("llama"), "eagle"), tmp_path / "x", folder)
    with pytest.raises(ValueError, match="is the target's own folder"):
        export_mtp_into_target(heads, folder)
    glm = write_mtp_target(tmp_path / "glm", "glm4_moe")
    with pytest.raises(ValueError, match="checkpoint has no .*kv_a_layernorm.*not made from this target's MTP layer"):
        export_mtp_into_target(heads, tmp_path / "y", glm)  # DeepSeek's layer into GLM's folder
    load_mtp_target(folder).save_pretrained(tmp_path / "resaved")  # transformers drops the MTP layer it did not load
    with pytest.raises(ValueError, match="holds no model.layers.61.* tensors"):
        export_mtp_into_target(heads, tmp_path / "v", tmp_path / "resaved")
    fp8 = tmp_path / "fp8"
    shutil.copytree(folder, fp8)
    tensors = load_file(fp8 / "model.safetensors")
    tensors["model.layers.61.eh_proj.weight"] = tensors["model.layers.61.eh_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, fp8 / "model.safetensors")
    with pytest.raises(ValueError, match="eh_proj.weight is torch.float8_e4m3fn: a quantized checkpoint"):
        export_mtp_into_target(heads, tmp_path / "z", fp8)
    with pytest.raises(SystemExit):  # argparse's usage error: --target is --format mtp's
        main(["export", "--heads", str(folder), "--format", "eagle", "--out", str(tmp_path / "w"), "--target", "T"])
