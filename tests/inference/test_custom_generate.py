"""Heads used from plain transformers: `target.generate(..., custom_generate=HEADS, trust_remote_code=True)`."""

from __future__ import annotations

import json

import pytest
import torch

from specheads import SpeculativeLM, load_heads
from specheads.cli import main
from specheads.inference.custom_generate import export_for_transformers, generate_with_heads

from .conftest import TARGETS, hf_greedy, left_pad, make_heads


@pytest.fixture(scope="module")
def heads_folder(target_and_prompt, tmp_path_factory):
    """Fresh EAGLE heads for the parametrized target, exported for transformers (local: the folder names itself)."""
    target, _ = target_and_prompt
    saved = tmp_path_factory.mktemp("heads")
    make_heads(target, "eagle").save_pretrained(saved)
    return export_for_transformers(saved, tmp_path_factory.mktemp("exported") / "heads")


def test_greedy_through_transformers_generate_is_the_targets_own(target_and_prompt, heads_folder):
    """On each architecture: identical to the target's own greedy generate, and decoded by the heads (stats)."""
    target, ids = target_and_prompt
    stats: dict = {}
    out = target.generate(ids, max_new_tokens=24, custom_generate=str(heads_folder), trust_remote_code=True,
                          stats=stats)
    torch.testing.assert_close(out, hf_greedy(target, ids, 24), rtol=0, atol=0)
    assert stats["new_tokens"] == 24 and 0 < stats["target_forwards"] <= 24 and "mean_accepted" in stats


@pytest.mark.parametrize("target_and_prompt", [TARGETS[0]], indirect=True)
def test_sampling_and_batches_go_through_unchanged(target_and_prompt, heads_folder):
    """Sampling settings reach the engine: same seed, same tokens as SpeculativeLM.generate; left-padded batches
    (attention_mask) give the target's own greedy rows."""
    target, ids = target_and_prompt
    settings = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(3)
    through_transformers = target.generate(ids, custom_generate=str(heads_folder), trust_remote_code=True, **settings)
    torch.manual_seed(3)
    direct = SpeculativeLM(target, load_heads(heads_folder, target=target)).generate(ids, **settings)
    torch.testing.assert_close(through_transformers, direct, rtol=0, atol=0)
    batch, mask = left_pad([[1, 400, 32, 57, 9], [1, 72, 9]])
    out = target.generate(batch, attention_mask=mask, max_new_tokens=16, custom_generate=str(heads_folder),
                          trust_remote_code=True, pad_token_id=0)
    torch.testing.assert_close(out, hf_greedy(target, batch, 16, attention_mask=mask, pad_token_id=0), rtol=0, atol=0)


def test_arguments_it_cannot_honour_are_refused_by_name(stories260k, tmp_path):
    target, tokenizer = stories260k
    make_heads(target, "eagle").save_pretrained(tmp_path)
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="assistant_model=...\\) is not supported"):
        generate_with_heads(target, tmp_path, input_ids=ids, assistant_model=target)
    with pytest.raises(TypeError, match="unknown argument .colour.: not a generation setting"):
        generate_with_heads(target, tmp_path, input_ids=ids, colour="red")
    with pytest.raises(ValueError, match="num_beams"):  # a generation-config field the engine refuses by name
        generate_with_heads(target, tmp_path, input_ids=ids, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="synced_gpus=True\\) is not supported"):
        generate_with_heads(target, tmp_path, input_ids=ids, synced_gpus=True)
    with pytest.raises(ValueError, match="as `inputs` or as `input_ids`, not both"):
        generate_with_heads(target, tmp_path, inputs=ids, input_ids=ids)
    # fields the engine takes as they are (num_beams=1, use_cache) and transformers' None placeholders pass
    out = generate_with_heads(target, tmp_path, inputs=ids, num_beams=1, use_cache=True, synced_gpus=False,
                              streamer=None, max_new_tokens=8)
    torch.testing.assert_close(out, hf_greedy(target, ids, 8), rtol=0, atol=0)


def test_pushed_heads_name_their_repository(stories260k, tmp_path, offline_hub_cache):
    """export --repo-id / push_to_hub: custom_generate names the Hub id; from the (offline) Hub cache it decodes."""
    target, tokenizer = stories260k
    make_heads(target, "eagle").save_pretrained(tmp_path / "saved")
    assert main(["export", "--heads", str(tmp_path / "saved"), "--format", "transformers", "--out",
                 str(tmp_path / "repo"), "--repo-id", "test-org/story-heads"]) == 0
    shim = (tmp_path / "repo" / "custom_generate" / "generate.py").read_text()
    assert "HEADS = 'test-org/story-heads'" in shim
    assert (tmp_path / "repo" / "custom_generate" / "requirements.txt").read_text().startswith("specheads>=")
    offline_hub_cache.publish(tmp_path / "repo", "test-org/story-heads")
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=16, custom_generate="test-org/story-heads", trust_remote_code=True)
    torch.testing.assert_close(out, hf_greedy(target, ids, 16), rtol=0, atol=0)


def test_push_to_hub_writes_custom_generate(stories260k, monkeypatch):
    """The pushed repository holds custom_generate/ naming itself, and its card shows the transformers call."""
    import transformers.utils.hub as transformers_hub
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    uploaded: dict[str, str] = {}

    class FakeHub:
        def create_repo(self, repo_id, **kwargs):
            return type("Repo", (), {"repo_id": repo_id})()

        def create_commit(self, repo_id, operations, **kwargs):
            for op in operations:
                uploaded[op.path_in_repo] = open(op.path_or_fileobj, "rb").read().decode(errors="replace")

    def no_card(cls, *args, **kwargs):
        raise EntryNotFoundError("new repo")

    monkeypatch.setattr(transformers_hub, "hf_api", lambda: FakeHub())
    monkeypatch.setattr(ModelCard, "load", classmethod(no_card))
    make_heads(stories260k[0], "eagle").push_to_hub("test-org/pushed-heads")
    assert "HEADS = 'test-org/pushed-heads'" in uploaded["custom_generate/generate.py"]
    assert "custom_generate/requirements.txt" in uploaded
    assert 'custom_generate="test-org/pushed-heads"' in uploaded["README.md"]
    assert json.loads(uploaded["config.json"])["head_type"] == "eagle"


def test_export_checks_the_checkpoint_and_the_option(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["export", "--heads", str(tmp_path / "empty"), "--format", "transformers", "--out",
                 str(tmp_path / "x")]) == 2
    assert "has no config.json" in capsys.readouterr().err and not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["export", "--heads", str(tmp_path / "empty"), "--format", "medusa", "--out", str(tmp_path / "y"),
              "--repo-id", "a/b"])
    assert "--repo-id goes with --format transformers" in capsys.readouterr().err


def test_text_generation_pipeline_takes_the_heads(stories260k, tmp_path):
    """transformers' pipeline passes custom_generate through to generate: same text, decoded by the heads."""
    from transformers import pipeline

    target, tokenizer = stories260k
    make_heads(target, "eagle").save_pretrained(tmp_path / "saved")
    folder = export_for_transformers(tmp_path / "saved", tmp_path / "exported")
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    stats: dict = {}
    got = pipe("Once upon a time", max_new_tokens=20, do_sample=False, custom_generate=str(folder),
               trust_remote_code=True, stats=stats)
    assert got == pipe("Once upon a time", max_new_tokens=20, do_sample=False) and stats["new_tokens"] == 20
