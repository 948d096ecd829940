"""Shared fixtures: the embedded stories260K target and tiny random targets of several families.

Nothing here downloads: stories260K ships inside the package and the tiny targets are built from
configs in code with fixed seeds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download

# Tiny models gain nothing from intra-op threads, and two torch processes on this 2-core machine
# oversubscribe it badly (docs/NOTES.md): one thread keeps the suite fast and its timings stable.
torch.set_num_threads(1)

TINY_FAMILIES = ("llama", "qwen2", "mistral")  # the Llama-shaped families most tests run on
# Families whose decoder layers differ from Llama's (EAGLE heads then own a Llama layer: heads/eagle.py), or that
# keep their own layer with something else different, each with what makes it differ; Gemma 2 / 3 get a sliding
# window of 8 so that generation reaches past it.
OTHER_FAMILIES = {
    "qwen3": {},  # q/k norms inside attention: keeps its own layer
    "gemma": {},  # (1 + w) RMSNorm, scaled embeddings: keeps its own layer
    "gemma2": dict(head_dim=16, sliding_window=8),  # attention logit soft-capping (SDPA cannot), capped logits
    "gemma3_text": dict(head_dim=16, sliding_window=8),  # rotary embeddings per layer type, 4 norms a layer
    "phi3": {},  # fused qkv projection
    "olmo2": {},  # post-norm layers
    "cohere": {},  # parallel attention and MLP, scaled logits
    "gpt_neox": {},  # parallel residual, partial rotary, no "DecoderLayer" class
    "gpt2": {},  # learned absolute positions, Conv1D layers, no rotary embedding
    "mixtral": {},  # mixture-of-experts MLP
    "gpt_oss": dict(sliding_window=8),  # experts, attention sinks, sliding and full layers in turn
    "starcoder2": {},  # LayerNorm and an ungated MLP with biases: keeps its own layer
}


def build_tiny_target(family: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A random 2-layer target of `family` (a transformers model_type; hidden 64, vocab 97, no EOS), in eval mode
    with gradients off."""
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=None,  # no EOS by default: tests that want one pass eos_token_id
        pad_token_id=0,
    )
    fields.update(OTHER_FAMILIES.get(family, {}))
    fields.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def stories260k():
    """(target, tokenizer) of the embedded stories260K Llama (5 layers, vocab 512)."""
    from specheads import load_target

    return load_target("stories260K")


@pytest.fixture(scope="session")
def tiny_target_factory():
    """`make(family, seed=0, **config_overrides)` -> a cached tiny random target (treat it as read-only)."""
    built: dict[tuple, PreTrainedModel] = {}

    def make(family: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = build_tiny_target(family, seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_target_factory):
    return tiny_target_factory("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_target_factory):
    return tiny_target_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_target_factory):
    return tiny_target_factory("mistral")


# --- foundation fixtures (heads checkpoints, Hub cache, CLI) --------------------------------------------
@pytest.fixture(scope="session")
def stories260k_eagle_dir(stories260k, tmp_path_factory):
    """A folder holding untrained EAGLE heads for stories260K, written by `save_pretrained` (seeded)."""
    from specheads import create_heads

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("stories260k_eagle")
    create_heads(stories260k[0], "eagle").save_pretrained(folder)
    return folder


class OfflineHubCache:
    """A Hugging Face Hub cache folder built by hand: `models--org--name/{refs/main, snapshots/<hash>/}`."""

    def __init__(self, root) -> None:
        self.root = root

    def publish(self, folder, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567", repo_type: str = "model"):
        """Copy `folder`'s files into the cache as `repo_id` at `commit` (refs/main points at it); return the snapshot."""
        import shutil

        repo = self.root / (f"{repo_type}s--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / commit
        shutil.copytree(folder, snapshot)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        return snapshot


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch) -> OfflineHubCache:
    """An empty offline Hub cache that this process uses for the duration of the test.

    Sets HF_HUB_OFFLINE=1, HF_HUB_CACHE and HF_HOME for child processes; huggingface_hub reads those at
    import time, so the already-imported `huggingface_hub.constants` are patched too (that is what
    `snapshot_download` and transformers' `cached_file` read at call time).
    """
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HOME", str(cache.parent))
    import datasets  # load_dataset's arrow cache of Hub datasets: in the test's folder too, not the user's

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache.parent / "datasets")
    return OfflineHubCache(cache)


class FakeHubApi:
    """Stands in for huggingface_hub.HfApi's create_repo / upload_folder: records the repos and uploaded files."""

    def __init__(self, fail: bool = False) -> None:
        self.repos: list[tuple[str, bool]] = []
        self.files: dict[str, str] = {}
        self.fail = fail

    def install(self, monkeypatch) -> FakeHubApi:
        import huggingface_hub

        hub = self

        def create_repo(api, repo_id, private=False, exist_ok=False, **kwargs):
            if hub.fail:
                raise RuntimeError("401 Unauthorized: no token")
            hub.repos.append((repo_id, private))

        def upload_folder(api, repo_id, folder_path, commit_message=None, **kwargs):
            for path in Path(folder_path).rglob("*"):
                if path.is_file():
                    hub.files[path.relative_to(folder_path).as_posix()] = path.read_bytes().decode(errors="replace")
            return type("Commit", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/abc"})()

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        return self


@pytest.fixture
def fake_hub_api(monkeypatch):
    """`install(fail=False)` -> a FakeHubApi patched into huggingface_hub.HfApi for this test (fail: every call raises)."""

    def install(fail: bool = False) -> FakeHubApi:
        return FakeHubApi(fail).install(monkeypatch)

    return install
