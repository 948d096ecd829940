"""Tiny random targets shipped with an MTP layer, in their families' checkpoint layouts (tests of heads/mtp.py):
DeepSeek-V3, GLM-4.5 and Mellum (read by transformers' MtpModel), Qwen3.5 / Qwen3.5-MoE / Qwen3-Next and GLM-4.7-Flash
(heads/checkpoint_mtp.py).

transformers finds a family's MTP tensors by the layer index its real checkpoints use (DeepSeek-V3: `model.layers.61.*`,
GLM-4.5-Air: `model.layers.46.*`), so these targets have that many (tiny) decoder layers, then the MTP layer: a decoder
layer of the family (written by transformers' own save_pretrained, so in the checkpoint's names) plus the MTP module's
norms and projection.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from .conftest import HYBRID_FAMILIES

# family -> (decoder layers before the MTP layer, the family's own fields for a tiny config). DeepSeek-V3 and GLM-4.5
# keep the MTP layer as decoder layer N (`model.layers.N.*`); Mellum under `mtp.*` (`fc`, `pre_fc_norm_*`, `norm`,
# `layers.0.*`), a sliding-window layer of its own type.
MTP_FAMILIES = {
    "deepseek_v3": (61, dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             first_k_dense_replace=1, n_group=1, topk_group=1)),
    "glm4_moe": (46, dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                          n_group=1, topk_group=1)),
    "mellum": (2, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention", "full_attention"])),
}
# Families whose MTP layer transformers does not load (heads/checkpoint_mtp.py reads it). Qwen3-Next / Qwen3.5 keep
# one full-attention MTP layer under `mtp.*` in Mellum's names; the target: a Gated DeltaNet layer and a full-attention
# one (the hybrid test families), then the MTP layer, dense or mixture-of-experts. GLM-4.7-Flash keeps it after its
# decoder layers in DeepSeek-V3's names (MLA attention, experts; a dense first layer).
QWEN_MTP_FAMILIES = {family: (2, dict(HYBRID_FAMILIES[family], tie_word_embeddings=False,
                                      layer_types=["linear_attention", "full_attention", "full_attention"]))
                     for family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")}
CHECKPOINT_MTP_FAMILIES = {**QWEN_MTP_FAMILIES, "glm4_moe_lite": (2, dict(
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, tie_word_embeddings=False,
    mlp_layer_types=["dense", "sparse", "sparse"]))}
MELLUM_NAMES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "shared_head.norm": "norm",
                "eh_proj": "fc"}  # the DeepSeek layout's MTP module names -> Mellum's (under `mtp.`)


def write_mtp_target(folder: Path, family: str, vocab_size: int = 97, seed: int = 0, cycling: bool = False,
                     tokenizer_from: Path | None = None) -> Path:
    """Write a tiny random `family` target with one MTP layer to `folder` (config.json + model.safetensors, as the
    family's released checkpoints hold it) and return the folder.

    `cycling`: every attention and MLP output projection is zero, so the residual stream is the token's embedding,
    and the lm_head's rows are the embedding's permuted: the target's next token is `cycle_of(folder)`[x] after x.
    The MTP layer reads only the embedding of x_{t+1} (`eh_proj` = [I, 0], norms of 1): it predicts x_{t+2} exactly, and
    any misalignment of what it reads would make it wrong. `tokenizer_from`: a folder whose tokenizer files are
    copied (for the command line; its vocabulary must be `vocab_size`)."""
    layers, extra = {**MTP_FAMILIES, **CHECKPOINT_MTP_FAMILIES}[family]
    qwen = family in QWEN_MTP_FAMILIES
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers + 1, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=vocab_size, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields))
    model.save_pretrained(folder)  # the last decoder layer becomes the MTP layer's block
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=layers)
    config.update({"mtp_num_hidden_layers" if qwen else "num_nextn_predict_layers": 1})
    if qwen:
        config.update(layer_types=config["layer_types"][:layers])
    if family == "glm4_moe_lite":
        config.update(mlp_layer_types=config["mlp_layer_types"][:layers])
    if family == "mellum":  # per-layer lists, the MTP layer's own types
        config.update(layer_types=config["layer_types"][:layers], mlp_layer_types=config["mlp_layer_types"][:layers],
                      mtp_layer_types=["sliding_attention"], mtp_mlp_layer_types=["sparse"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(folder / "model.safetensors")
    hidden, generator, prefix = fields["hidden_size"], torch.Generator().manual_seed(seed + 1), f"model.layers.{layers}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{name}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors[f"{prefix}eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    if cycling:
        for name in [n for n in tensors if n.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight"))]:
            tensors[name] = torch.zeros_like(tensors[name])
        for name in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{name}.weight"] = torch.ones(hidden)
        tensors[f"{prefix}eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        # lm_head row cycle[x] = embedding row x (scaled): after x, cycle[x] is all but certain
        cycle = torch.randperm(vocab_size, generator=generator)
        tensors["lm_head.weight"] = 50 * tensors["model.embed_tokens.weight"][torch.argsort(cycle)]  # peaked
        (folder / "cycle.json").write_text(json.dumps(cycle.tolist()))
    if family == "mellum" or qwen:
        tensors = {mellum_name(name, prefix): tensor for name, tensor in tensors.items()}
    else:
        tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()  # DeepSeek's copies
        tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.model", "tokenizer_config.json") if tokenizer_from is not None else ():
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def mellum_name(name: str, prefix: str) -> str:
    """A tensor's name in Mellum's layout, from the DeepSeek layout's (MTP layer under `prefix`)."""
    if not name.startswith(prefix):
        return name
    inner = name.removeprefix(prefix).removesuffix(".weight")
    return f"mtp.{MELLUM_NAMES[inner]}.weight" if inner in MELLUM_NAMES else f"mtp.layers.0.{name.removeprefix(prefix)}"


def cycle_of(folder: Path) -> list[int]:
    """The next token after each token of a `cycling` target."""
    return json.loads((folder / "cycle.json").read_text())


def load_mtp_target(folder: Path) -> torch.nn.Module:
    """The target of `write_mtp_target` (its MTP tensors left in the file, as transformers loads such models)."""
    return AutoModelForCausalLM.from_pretrained(folder).eval().requires_grad_(False)


def mtp_layer_inputs(target: torch.nn.Module, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an MTP layer reads at every position of a (1, n) `prompt`: (the target's final, post-norm features f_t
    (1, n, h), the tokens x_{t+1} after them (1, n): the prompt shifted, then 7), and the (1, 1, n, n) causal mask."""
    n = prompt.shape[1]
    with torch.no_grad():
        features = target(prompt, output_hidden_states=True).hidden_states[-1]
    next_ids = torch.cat([prompt[:, 1:], torch.tensor([[7]])], dim=1)
    return features, next_ids, torch.full((1, 1, n, n), torch.finfo(torch.float32).min).triu(1)
