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

# Hybrid families (recurrent / convolution layers beside attention), verified one chain a round
# (inference/chain_verify.py): one state layer then one attention layer each, with sizes that fit hidden 64.
_DELTANET = dict(head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MAMBA2 = dict(mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32, mamba_chunk_size=8)
HYBRID_FAMILIES = {
    "qwen3_5_text": _DELTANET,  # Gated DeltaNet (Qwen3.5)
    "qwen3_5_moe_text": dict(_DELTANET, **_EXPERTS),
    "qwen3_next": dict(_DELTANET, **_EXPERTS),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # short convolutions (LFM2)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_experts=2, num_experts_per_tok=1,
                     moe_intermediate_size=32, num_dense_layers=1),
    "granitemoehybrid": dict(_MAMBA2, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
                             shared_intermediate_size=64),  # Mamba-2 (Granite 4)
    "bamba": dict(_MAMBA2, attn_layer_indices=[1]),
    "nemotron_h": dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8,
                       n_groups=1, chunk_size=8),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                      mamba_chunk_size=8),  # attention and Mamba-2 side by side in every layer
    "zamba2": dict(mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
                   chunk_size=8),
    "olmo_hybrid": {},
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
    fields.update(OTHER_FAMILIES.get(family, HYBRID_FAMILIES.get(family, {})))
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


# --- vision-language targets ---------------------------------------------------------------------------------
VLM_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3")
VLM_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=160, max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0)
VLM_IMAGE, VLM_START, VLM_END = 150, 152, 153  # image placeholder, begin / end of an image


def build_tiny_vlm(family: str, seed: int = 0) -> tuple[PreTrainedModel, torch.Tensor, dict[str, torch.Tensor]]:
    """(a random 2-layer vision-language target of `family`, a (1, n) prompt with one image, the prompt's extra inputs
    as the family's processor would return them). Qwen2-VL / Qwen2.5-VL (M-RoPE) get an 8 x 8 patch grid, whose 16
    image tokens take 4 rotary positions, and sharper attention (initializer_range 0.3), so that text positions off
    by the grid's delta give other tokens."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    pixels = torch.Generator().manual_seed(seed + 1)
    small_vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                        patch_size=4)
    if family == "llava":
        config = AutoConfig.for_model(
            "llava", text_config=dict(model_type="llama", **VLM_TEXT), image_token_id=VLM_IMAGE, vision_feature_layer=-1,
            vision_config=dict(model_type="clip_vision_model", projection_dim=16, **small_vision))
        ids = [3, 14, *[VLM_IMAGE] * 16, 15, 92, 65]  # (16 / 4)^2 patches
        inputs = dict(pixel_values=torch.randn(1, 3, 16, 16, generator=pixels))
    elif family in ("qwen2_vl", "qwen2_5_vl", "qwen3_5"):  # M-RoPE; Qwen3.5: a hybrid, verified a chain a round
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        text = dict(VLM_TEXT, initializer_range=0.3, rope_parameters=rope)
        vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
        if family == "qwen2_vl":
            vision.update(embed_dim=16)
        elif family == "qwen2_5_vl":
            vision.update(intermediate_size=32, out_hidden_size=32, fullatt_block_indexes=[0], window_size=8)
        else:  # Gated DeltaNet and gated attention layers, a quarter of each head rotated
            text.update(HYBRID_FAMILIES["qwen3_5_text"])
            rope.update(mrope_section=[1, 1, 0], mrope_interleaved=True, partial_rotary_factor=0.25)
            vision.update(intermediate_size=32, out_hidden_size=32, num_position_embeddings=16)
        config = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=VLM_IMAGE,
                                      video_token_id=151, vision_start_token_id=VLM_START, vision_end_token_id=VLM_END)
        ids = [3, 14, VLM_START, *[VLM_IMAGE] * 16, VLM_END, 15, 92, 65]  # 8 x 8 patches, merged 2 x 2
        inputs = dict(pixel_values=torch.randn(64, 3 * 2 * 4 * 4, generator=pixels),
                      image_grid_thw=torch.tensor([[1, 8, 8]]),
                      mm_token_type_ids=torch.tensor([[int(i == VLM_IMAGE) for i in ids]]))
    elif family == "gemma3":  # bidirectional attention inside the image, sliding-window layers
        config = AutoConfig.for_model(
            "gemma3", text_config=dict(model_type="gemma3_text", head_dim=16, sliding_window=8, **VLM_TEXT),
            vision_config=dict(model_type="siglip_vision_model", **small_vision), mm_tokens_per_image=4,
            image_token_id=VLM_IMAGE, boi_token_index=VLM_START, eoi_token_index=VLM_END)
        ids = [3, 14, VLM_START, *[VLM_IMAGE] * 4, VLM_END, 15, 92, 65]
        inputs = dict(pixel_values=torch.randn(1, 3, 16, 16, generator=pixels),
                      token_type_ids=torch.tensor([[int(i == VLM_IMAGE) for i in ids]]))
    elif family == "idefics3":  # SmolVLM's architecture
        config = AutoConfig.for_model(
            "idefics3", text_config=dict(model_type="llama", **VLM_TEXT), scale_factor=2, image_token_id=VLM_IMAGE,
            vision_config=dict(model_type="idefics3_vision", **small_vision))
        ids = [3, 14, *[VLM_IMAGE] * 4, 15, 92, 65]
        inputs = dict(pixel_values=torch.randn(1, 1, 3, 16, 16, generator=pixels),
                      pixel_attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))
    else:
        raise ValueError(f"no tiny vision-language target for {family!r}; expected one of {VLM_FAMILIES} or qwen3_5")
    model = AutoModelForImageTextToText.from_config(config)
    return model.eval().requires_grad_(False), torch.tensor([ids]), inputs


@pytest.fixture(scope="session")
def tiny_vlm_factory():
    """`make(family)` -> a cached (tiny random vision-language target, prompt ids, extra inputs) (`build_tiny_vlm`)."""
    built: dict[str, tuple] = {}

    def make(family: str):
        if family not in built:
            built[family] = build_tiny_vlm(family)
        return built[family]

    return make


@pytest.fixture(scope="session")
def story_vlm_dir(stories260k, tmp_path_factory) -> Path:
    """A LLaVA folder whose language model is stories260K (its vocabulary plus an `<image>` token, id 512) behind a
    random CLIP tower (16 x 16 pixels, 16 image tokens), with a LlavaProcessor and chat template: a vision-language
    target whose text side writes stories, so that heads trained on its text draft well."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from specheads.targets import ALIASES

    target, _ = stories260k
    tokenizer = AutoTokenizer.from_pretrained(ALIASES["stories260k"])  # a copy: the session's tokenizer stays as is
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = target.config.to_dict()
    text["vocab_size"] = len(tokenizer)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(
        text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        tie_word_embeddings=True,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4, projection_dim=32)))
    state = target.model.state_dict()
    embedding = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = torch.cat([embedding, embedding.mean(0, keepdim=True)])  # the <image> row
    model.model.language_model.load_state_dict(state)
    with torch.no_grad():  # image embeddings of a word's scale: a random tower's full-size ones derail the stories
        model.model.multi_modal_projector.linear_2.weight.mul_(0.05)
    template = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
                "{% endfor %}{% endif %}{% endfor %}")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tokenizer, patch_size=4, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=template)
    folder = tmp_path_factory.mktemp("story_vlm")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


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
