"""Pushing heads folders to the Hub (`specheads push`, training's `push_to_hub`), against a fake Hub API."""

from __future__ import annotations

import pytest

from specheads import create_heads
from specheads.cli import main
from specheads.heads.describe import card_metrics
from specheads.heads.hub import push_heads_folder


@pytest.fixture
def heads_folder(stories260k, tmp_path):
    heads = create_heads(stories260k[0], "eagle")
    heads.model_card_metrics = {"eval_sim_tau": 2.5, "steps": 7}
    heads.save_pretrained(tmp_path / "best")
    return tmp_path / "best"


def test_push_uploads_the_folder_with_a_card_and_custom_generate_naming_the_repo(heads_folder, fake_hub_api):
    hub = fake_hub_api()
    before = sorted(p.name for p in heads_folder.iterdir())
    url = push_heads_folder(heads_folder, "test-org/my-heads", private=True)
    assert url == "https://huggingface.co/test-org/my-heads/commit/abc" and hub.repos == [("test-org/my-heads", True)]
    assert {"config.json", "model.safetensors", "README.md", "custom_generate/generate.py",
            "custom_generate/requirements.txt"} <= set(hub.files)
    assert "HEADS = 'test-org/my-heads'" in hub.files["custom_generate/generate.py"]
    card = hub.files["README.md"]
    assert 'heads="test-org/my-heads"' in card and 'custom_generate="test-org/my-heads"' in card
    assert '"eval_sim_tau": 2.5' in card  # the folder's metrics travel with it
    assert sorted(p.name for p in heads_folder.iterdir()) == before  # the local folder is left as it was
    assert card_metrics(heads_folder) == {"eval_sim_tau": 2.5, "steps": 7}


def test_push_keeps_a_hand_written_card(heads_folder, fake_hub_api):
    """Notes added to the card travel unchanged; only the usage example learns the repository."""
    hub = fake_hub_api()
    card = heads_folder / "README.md"
    card.write_text(card.read_text() + "\n## How these were trained\n\nOn my own data, 3 epochs.\n")
    push_heads_folder(heads_folder, "test-org/noted")
    pushed = hub.files["README.md"]
    assert pushed.startswith(card.read_text().split("heads=")[0]) and "On my own data, 3 epochs." in pushed
    assert 'heads="test-org/noted"' in pushed and "path/to/this/folder" not in pushed
    assert pushed.count('custom_generate="test-org/noted"') == 1


def test_push_checks_the_folder_first_and_names_hub_failures(heads_folder, tmp_path, fake_hub_api):
    hub = fake_hub_api()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        push_heads_folder(tmp_path / "empty", "test-org/x")
    assert not hub.repos and not hub.files
    fake_hub_api(fail=True)
    with pytest.raises(OSError, match="pushing .*best to the Hub repository 'test-org/x' failed: 401 Unauthorized"):
        push_heads_folder(heads_folder, "test-org/x")


def test_push_command(heads_folder, fake_hub_api, capsys):
    hub = fake_hub_api()
    assert main(["push", str(heads_folder), "--repo-id", "test-org/cli-heads"]) == 0
    assert "pushed" in capsys.readouterr().out and hub.repos == [("test-org/cli-heads", False)]
    fake_hub_api(fail=True)
    assert main(["push", str(heads_folder), "--repo-id", "test-org/cli-heads"]) == 2
    assert "specheads: error: pushing" in capsys.readouterr().err
