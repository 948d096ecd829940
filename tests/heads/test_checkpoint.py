"""Heads as Hugging Face checkpoints: save/load round trips, the folder's contents, loading by Hub id from
an offline cache, and the clear errors a user gets for missing, corrupt, invalid or mismatched checkpoints."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import specheads
from specheads import HEAD_TYPES, create_heads, load_heads
from specheads.heads import DraftHeads
from specheads.inference.generate import SpeculativeLM

OPTIONS = {"medusa": {"num_heads": 3}, "eagle": {}}


def _outputs(heads: DraftHeads, target, eagle_inputs) -> torch.Tensor:
    """Deterministic outputs of `heads` on fixed inputs: Medusa logits or EAGLE predicted-feature logits."""
    inputs = eagle_inputs(target, batch=2, length=5, seed=1)
    with torch.no_grad():
        if heads.config.head_type == "medusa":
            return heads(inputs["features"])
        if heads.config.head_type == "dflash":  # the context, then a block of as many tokens after it
            positions = inputs["position_ids"]
            return heads.logits(heads(inputs["features"], inputs["input_ids"], positions, positions + positions.shape[1]))
        return heads.logits(heads(**inputs))


def _trained_like(heads: DraftHeads, seed: int = 0) -> DraftHeads:
    """Perturb every weight so a round trip must carry real values (fresh Medusa blocks are all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
    return heads.eval()


@pytest.fixture(params=HEAD_TYPES)
def saved(request, make_tiny_target, tmp_path):
    """(target, heads, folder): perturbed heads of each type for a tiny Llama, saved with save_pretrained."""
    target = make_tiny_target("llama")
    torch.manual_seed(0)
    heads = _trained_like(create_heads(target, request.param, **OPTIONS.get(request.param, {})))
    folder = tmp_path / f"{request.param}-heads"
    heads.save_pretrained(folder)
    return target, heads, folder


# --- round trips and the folder ---------------------------------------------------------------------------
def test_round_trip_gives_identical_outputs(saved, eagle_inputs):
    """save_pretrained -> load_heads(target=...) reproduces the outputs bit for bit."""
    target, heads, folder = saved
    loaded = load_heads(folder, target=target)
    assert type(loaded) is type(heads)
    assert not loaded.training
    torch.testing.assert_close(
        _outputs(loaded, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0
    )
    for key, tensor in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def test_load_without_target_then_attach(saved, eagle_inputs):
    """Heads load without a target and work once attached."""
    target, heads, folder = saved
    loaded = load_heads(str(folder))
    loaded.attach_target(target)
    torch.testing.assert_close(
        _outputs(loaded, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0
    )


def test_folder_contents(saved, expected_feature_layers):
    """The folder is a plain HF checkpoint: config.json with the target's description, safetensors, a card."""
    target, heads, folder = saved
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".pkl"))]

    config = json.loads((folder / "config.json").read_text())
    assert config["head_type"] == heads.config.head_type
    assert config["format_version"] == specheads.heads.config.FORMAT_VERSION
    assert config["specheads_version"] == specheads.__version__
    assert config["target_name_or_path"] == "tiny-org/tiny-llama"
    assert config["target_architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == target.config.hidden_size
    assert config["vocab_size"] == target.config.vocab_size
    layers = target.config.num_hidden_layers
    assert config["feature_layers"] == expected_feature_layers(heads.config.head_type, layers)

    card = (folder / "README.md").read_text()
    assert "tiny-org/tiny-llama" in card
    assert heads.config.head_type in card


def test_safetensors_hold_head_weights_only(saved):
    """model.safetensors holds exactly the heads' state_dict; EAGLE stores no embedding or lm_head (EAGLE-3's
    lm_head is its own projection onto the draft vocabulary, not the target's)."""
    target, heads, folder = saved
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == set(heads.state_dict())
    own_lm_head = heads.config.head_type == "eagle3"
    assert not [k for k in tensors if "embed" in k or ("lm_head" in k and not own_lm_head)]
    if heads.config.head_type == "eagle":
        v, h = target.config.vocab_size, target.config.hidden_size
        assert not [k for k, t in tensors.items() if tuple(t.shape) in {(v, h), (h, v)}]


class _FakeHubApi:
    """Stands in for the Hub in `push_to_hub`: records the files of the one commit instead of uploading."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            self.files[op.path_in_repo] = Path(op.path_or_fileobj).read_bytes()
        return SimpleNamespace(repo_id=repo_id)


@pytest.fixture
def fake_hub(monkeypatch) -> _FakeHubApi:
    """A fake Hub (no network): an empty new repo, commits recorded in memory."""
    import transformers.utils.hub as transformers_hub
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    def no_remote_card(cls, *args, **kwargs):
        raise EntryNotFoundError("no README.md in a new repo")

    api = _FakeHubApi()
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: api)
    monkeypatch.setattr(ModelCard, "load", classmethod(no_remote_card))
    return api


def test_push_to_hub_uploads_the_checkpoint(saved, fake_hub):
    """`push_to_hub` uploads config.json and model.safetensors (heads only), as transformers models do."""
    _, heads, _ = saved
    heads.push_to_hub("test-org/tiny-heads")
    assert {"config.json", "model.safetensors"} <= set(fake_hub.files)
    assert json.loads(fake_hub.files["config.json"])["head_type"] == heads.config.head_type
    assert not [name for name in fake_hub.files if name.endswith(".bin")]


def test_push_to_hub_uploads_the_specheads_model_card(saved, fake_hub):
    """The pushed README.md is the specheads card: it names the target and shows how to load the heads."""
    _, heads, _ = saved
    heads.push_to_hub("test-org/tiny-heads")
    card = fake_hub.files["README.md"].decode()
    assert "tiny-org/tiny-llama" in card
    assert "SpeculativeLM" in card


def test_stories260k_heads_record_the_alias(stories260k, stories260k_eagle_dir):
    """Heads for the embedded target record the portable alias, not this machine's asset path."""
    config = json.loads((stories260k_eagle_dir / "config.json").read_text())
    assert config["target_name_or_path"] == "stories260K"
    assert "stories260K" in (stories260k_eagle_dir / "README.md").read_text()
    assert load_heads(stories260k_eagle_dir, target=stories260k[0]).config.hidden_size == 64


# --- loading by Hub id ---------------------------------------------------------------------------------------
def test_load_by_hub_id_from_offline_cache(saved, offline_hub_cache, eagle_inputs):
    """`load_heads("org/name")` resolves through the HF cache (refs/main -> snapshots/<hash>) with the Hub offline."""
    target, heads, folder = saved
    snapshot = offline_hub_cache.publish(folder, "test-org/tiny-heads")
    loaded = load_heads("test-org/tiny-heads", target=target)
    assert loaded.name_or_path == str(snapshot) or Path(loaded.name_or_path).resolve() == snapshot.resolve()
    torch.testing.assert_close(
        _outputs(loaded, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0
    )


def test_load_by_hub_id_with_env_vars_only(stories260k_eagle_dir, tmp_path):
    """A user who sets HF_HUB_OFFLINE / HF_HUB_CACHE before starting Python loads heads by Hub id."""
    cache = tmp_path / "hub"
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    repo = cache / "models--test-org--stories-eagle"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in stories260k_eagle_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path))
    code = "from specheads import load_heads; h = load_heads('test-org/stories-eagle'); print(h.config.head_type, h.name_or_path)"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "eagle"
    assert commit in result.stdout


def test_unknown_hub_id_offline_is_file_not_found(offline_hub_cache):
    """A Hub id that is not in the offline cache raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="test-org/absent"):
        load_heads("test-org/absent")


def test_load_heads_accepts_cache_dir(saved, tmp_path, monkeypatch):
    """`load_heads(hub_id, cache_dir=...)` reads an explicit cache folder, like transformers' loaders."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _, _, folder = saved
    cache = tmp_path / "explicit-cache"
    commit = "0" * 40
    repo = cache / "models--test-org--explicit"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(folder, target_is_directory=True)
    assert load_heads("test-org/explicit", cache_dir=cache).config.hidden_size == 64


# --- errors -----------------------------------------------------------------------------------------------------
def test_missing_folder_names_it(tmp_path):
    """A folder that does not exist raises FileNotFoundError naming it."""
    missing = tmp_path / "no-such-heads"
    with pytest.raises(FileNotFoundError, match="no-such-heads"):
        load_heads(missing)


def test_folder_without_weights(saved):
    """A folder without model.safetensors raises FileNotFoundError naming the missing file."""
    _, _, folder = saved
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_heads(folder)


def test_folder_with_pickled_weights_only_is_refused(saved):
    """A pytorch_model.bin is never unpickled: loading asks for safetensors and names the pickle."""
    _, heads, folder = saved
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_heads(folder)


def test_folder_without_config(saved):
    """A folder without config.json raises FileNotFoundError naming config.json."""
    _, _, folder = saved
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_heads(folder)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    path.write_bytes(bytes(data))


def _huge_header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_truncate, _garble_header, _huge_header_length])
def test_corrupt_weights_name_the_file(saved, corrupt):
    """Truncated or overwritten model.safetensors raises ValueError naming the file."""
    _, _, folder = saved
    corrupt(folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_heads(folder)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", -64),
        ("vocab_size", 0),
        ("num_heads", -1),
        ("head_type", "nope"),
        ("format_version", 999),
        ("feature_layers", [-1]),
    ],
)
def test_invalid_config_values_name_the_field(saved, field, value):
    """config.json with an invalid value raises ValueError naming the field."""
    _, _, folder = saved
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=field):
        load_heads(folder)


def test_config_that_is_not_json(saved):
    """A config.json that is not JSON raises ValueError naming the file."""
    _, _, folder = saved
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json"):
        load_heads(folder)


def test_unknown_config_keys_are_dropped_with_a_warning(saved, caplog, eagle_inputs):
    """Keys from a newer specheads are dropped with a warning naming them, and the heads still load."""
    target, heads, folder = saved
    _edit_config(folder, future_option={"depth": 9}, another_new_key=1)
    with caplog.at_level(logging.WARNING):
        loaded = load_heads(folder, target=target)
    assert "future_option" in caplog.text and "another_new_key" in caplog.text
    assert not hasattr(loaded.config, "future_option")
    torch.testing.assert_close(
        _outputs(loaded, target, eagle_inputs), _outputs(heads, target, eagle_inputs), rtol=0, atol=0
    )


def test_missing_tensor_is_named(saved):
    """A checkpoint missing one tensor raises ValueError naming that tensor."""
    _, _, folder = saved
    tensors = load_file(folder / "model.safetensors")
    dropped = sorted(tensors)[-1]
    del tensors[dropped]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_heads(folder)


def test_unexpected_tensor_is_named(saved):
    """A checkpoint with an extra tensor raises ValueError naming it (the file is not what the config says)."""
    _, _, folder = saved
    tensors = load_file(folder / "model.safetensors")
    tensors["stray.weight"] = torch.zeros(2, 2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"stray\.weight"):
        load_heads(folder)


def test_tensor_with_wrong_shape_is_refused(saved):
    """A tensor of the wrong shape raises ValueError naming it."""
    _, _, folder = saved
    tensors = load_file(folder / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(*(d + 1 for d in tensors[name].shape))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_heads(folder)


@pytest.mark.parametrize(
    ("field", "other_size"), [("hidden_size", {"hidden_size": 32}), ("vocab_size", {"vocab_size": 101})]
)
def test_heads_for_another_target_are_refused(saved, make_tiny_target, field, other_size):
    """Heads attached to a target of another hidden size or vocabulary raise ValueError naming the field,
    both from `load_heads(path, target=...)` and from `SpeculativeLM(target, heads)`."""
    _, heads, folder = saved
    other = make_tiny_target("llama", **other_size)
    with pytest.raises(ValueError, match=field):
        load_heads(folder, target=other)
    with pytest.raises(ValueError, match=field):
        SpeculativeLM(other, heads)


def test_eagle_heads_for_another_family_are_refused(make_tiny_target):
    """EAGLE heads own a decoder layer of one family; a same-sized target of another family is refused."""
    heads = create_heads(make_tiny_target("llama"), "eagle")
    with pytest.raises(ValueError, match="model_type"):
        heads.attach_target(make_tiny_target("qwen2"))


def test_feature_layers_beyond_the_target_are_refused(saved):
    """Heads reading a hidden state the target does not have are refused, naming feature_layers."""
    target, heads, folder = saved
    with pytest.raises(ValueError, match="feature_layers"):
        create_heads(target, "medusa", feature_layers=[7])
    beyond = [7, 7, 7] if heads.config.head_type == "eagle3" else [7]  # EAGLE-3 reads exactly 3 layers
    _edit_config(folder, feature_layers=beyond)
    assert load_heads(folder).config.feature_layers == beyond  # valid on its own...
    with pytest.raises(ValueError, match="feature_layers"):
        load_heads(folder, target=target)  # ...but not for a 2-layer target


def test_create_heads_unknown_type_lists_known_types(make_tiny_target):
    """An unknown head type raises ValueError naming it and listing every registered type."""
    with pytest.raises(ValueError, match="nope") as err:
        create_heads(make_tiny_target("llama"), "nope")
    for name in HEAD_TYPES:
        assert name in str(err.value)


def test_create_heads_unknown_option(make_tiny_target):
    """An unknown option raises ValueError naming it."""
    with pytest.raises(ValueError, match="bogus"):
        create_heads(make_tiny_target("llama"), "eagle", bogus=1)


def test_create_heads_invalid_option_value(make_tiny_target):
    """A known option with an invalid value raises ValueError naming the field."""
    with pytest.raises(ValueError, match="num_heads"):
        create_heads(make_tiny_target("llama"), "medusa", num_heads=0)
