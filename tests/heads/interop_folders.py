"""Synthetic checkpoint folders in the public formats' layouts, shared by the interop tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def eagle3_inputs(target, eagle_inputs, seed: int) -> dict[str, torch.Tensor]:
    """`eagle_inputs` with (B, T, 3h) fused-target features, as EAGLE-3 heads read them."""
    inputs = eagle_inputs(target, batch=2, length=6, seed=seed)
    b, t, h = inputs["features"].shape
    inputs["features"] = torch.randn(b, t, 3 * h, generator=torch.Generator().manual_seed(seed))
    return inputs


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.1 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor], weights: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


def eagle_layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "post_attention_layernorm.weight": (h,),
    }


def llama_style_config(target) -> dict:
    """The config.json of an original EAGLE-1 checkpoint for `target` (LlamaConfig fields, "bias": true)."""
    c = target.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "bias": True,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "vocab_size": c.vocab_size,
    }
