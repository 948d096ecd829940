"""Which targets can verify a token tree in one forward exactly, and how long their contexts may grow.

Tree verification feeds the target every drafted node at once: each node at the position of its depth
(`position_ids`), seeing only its ancestors (a 4-D attention mask), and afterwards keeps the accepted path's
keys and values by slicing the KV cache. A target is served exactly only if all three hold for every layer:

- positions come from `position_ids` (rotary or learned embeddings). ALiBi models (BLOOM, MPT, Falcon with
  `alibi=True`) derive their position biases from key indices or the 2-D padding mask instead, so a tree's
  nodes would sit at the wrong distances (MPT then emits other tokens than its own `generate`: a silent error).
- every layer is attention with a KV cache. Recurrent, linear-attention and convolution layers fold every token
  into a state that cannot be cut back to the accepted path, and read a tree's nodes as one sequence. The hybrid
  families of `CHAIN_FAMILIES` (Qwen3.5, Qwen3-Next, LFM2, Granite 4, Falcon-H1, Nemotron-H, ...) are served with
  each path of a round's tree verified as a CHAIN instead (inference/chain_verify.py); the others (Mamba, Mamba-2, Jamba,
  RecurrentGemma, MiniMax, ...) are refused.
- the attention pattern is one the verifier rebuilds for tree nodes: full, or a sliding window (`verify.py`).
  Llama 4's chunked layers are served only while the whole run stays inside one chunk.

Vision-language targets are served when their images enter through the prompt's embeddings (LLaVA, Qwen2-VL,
Gemma 3, Idefics3, ...: inference/multimodal.py), not through cross-attention layers (Mllama).
"""

from __future__ import annotations

from transformers import PreTrainedModel

from specheads.heads.cache_keyword import declared_parameters

# attention patterns a tree forward reproduces (sliding windows are applied to the tree mask in verify.py)
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Hybrid families (text model_type) verified path by path, as chains (inference/chain_verify.py): transformers keeps their
# layers' states in its `LinearAttention*` cache layers, which can be copied and put back, and their forward continues
# a cached state over several new tokens exactly (tests/inference/test_hybrid_targets.py checks both per family).
# Mamba, Mamba-2 and Jamba continue a cached state over one new token only (their scan over several starts from
# zero), MiniMax keeps a cache of its own: they stay refused.
CHAIN_FAMILIES = frozenset({
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",  # Gated DeltaNet + gated attention
    "lfm2", "lfm2_moe",  # short convolutions + attention
    "granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "zamba2",  # Mamba-2 + attention
    "olmo_hybrid",
})


def uses_alibi(config) -> bool:
    """Whether the config asks for ALiBi position biases (Falcon's `alibi`, MPT's `attn_config.alibi`)."""
    if getattr(config, "alibi", False) is True:
        return True
    attn_config = getattr(config, "attn_config", None)
    flag = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    return flag is True


def unwrapped(target: PreTrainedModel) -> PreTrainedModel:
    """The transformers model inside a peft wrapper (`get_base_model`) or a `torch.compile` one (`_orig_mod`)."""
    while True:
        if hasattr(target, "get_base_model"):
            target = target.get_base_model()
        elif hasattr(target, "_orig_mod"):
            target = target._orig_mod
        else:
            return target


def verifies_chains(target: PreTrainedModel) -> bool:
    """Whether `target` is a hybrid of `CHAIN_FAMILIES`, whose trees are verified path by path, as chains."""
    return unwrapped(target).config.get_text_config().model_type in CHAIN_FAMILIES


def _chain_hint(chains: bool) -> str:
    if not chains:
        return ""
    return f" (the hybrids served with their trees' paths verified as chains: {', '.join(sorted(CHAIN_FAMILIES))})"


def tree_verification_problem(target: PreTrainedModel, chains: bool = False) -> str | None:
    """Why `target` cannot verify token trees exactly (see the module docstring), or None when it can; with
    `chains`, why it cannot verify a chain of drafts (None also for the hybrids of `CHAIN_FAMILIES`)."""
    target = unwrapped(target)
    config = target.config.get_text_config()
    name = f"{type(target).__name__} (model_type={config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model; speculative decoding here serves decoder-only targets"
    if chains and config.model_type in CHAIN_FAMILIES:
        return None
    if getattr(type(target), "_is_stateful", False):
        return (f"{name} keeps a recurrent state in its layers, which cannot be cut back to the accepted path of a "
                f"token tree{_chain_hint(chains)}")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES - {"chunked_attention"})
    if other:
        return (f"{name} has {', '.join(other)} layers; a token tree can only be verified by attention layers "
                f"({', '.join(sorted(SUPPORTED_LAYER_TYPES))}) whose KV cache is cut back to the accepted path"
                f"{_chain_hint(chains)}")
    if getattr(config, "cross_attention_layers", None):
        return (f"{name} has layers that cross-attend to the image (Mllama), whose image mask transformers' generate "
                "extends at every step and a tree forward does not; its hidden states also skip those layers")
    if "position_ids" not in declared_parameters(type(target).forward):
        return (f"{name}'s forward takes no position_ids, so the nodes of a token tree cannot be placed at their "
                "depth (ALiBi models such as BLOOM and MPT)")
    if uses_alibi(config):
        return (f"{name} uses ALiBi position biases, computed from key indices rather than position_ids, so the "
                "nodes of a token tree would sit at the wrong distances")
    return None


def check_tree_verification(target: PreTrainedModel, chains: bool = False) -> None:
    """Raise a ValueError naming the target and the reason when it cannot verify token trees (with `chains`: token
    trees or, for the hybrids of `CHAIN_FAMILIES`, chains) exactly."""
    problem = tree_verification_problem(target, chains)
    if problem is not None:
        raise ValueError(f"this target cannot be served with exact speculative decoding: {problem}")


def check_one_device(target: PreTrainedModel) -> None:
    """Raise a ValueError naming the devices when `target` is spread over several (a `device_map`, e.g. "auto" over
    two GPUs, or CPU / disk offload): the engine keeps the target's caches, its features and the heads on one device."""
    placed = getattr(unwrapped(target), "hf_device_map", None) or {}
    devices = sorted({str(device) for device in placed.values()})
    if len(devices) > 1:
        raise ValueError(
            f"the target is spread over {len(devices)} devices ({', '.join(devices)}: its device_map); speculative "
            "decoding here runs the target, its caches and the heads on one device: load the target onto one "
            "(device='cuda:0', or SpeculativeLM.from_pretrained(..., device=...))")


def context_limit(target: PreTrainedModel) -> tuple[int | None, str]:
    """(the most positions a generation may reach, what that limit is), (None, "") for no limit.

    The target's `max_position_embeddings`, or the chunk of Llama 4-style chunked-attention layers when smaller:
    the tree mask reproduces full and sliding-window attention, not a chunk boundary, so a run stays in one chunk.
    """
    config = target.config.get_text_config()
    limits = []
    if getattr(config, "max_position_embeddings", None):
        limits.append((int(config.max_position_embeddings), "the target's context"))
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        limits.append((int(chunk), "the target's attention chunk (chunked layers are verified as full attention, "
                                   "exact only inside one chunk)"))
    return min(limits) if limits else (None, "")
