"""specheads: speculative decoding with trained draft heads (Medusa, EAGLE).

    from specheads import load_target, create_heads, load_heads, SpeculativeLM
"""

__version__ = "0.1.0"

from specheads.heads import (  # noqa: E402
    HEAD_TYPES,
    DraftModelHeads,
    HeadsConfig,
    MtpHeads,
    create_heads,
    early_exit_model,
    load_heads,
)
from specheads.targets import load_target  # noqa: E402

__all__ = [
    "HEAD_TYPES", "BatchEngine", "ChatSession", "CorpusLookup", "DraftModelHeads", "HeadsConfig", "MtpHeads",
    "PromptCache", "ServingLoop", "SpeculativeLM",
    "__version__", "create_heads", "early_exit_model", "load_heads", "load_target",
]


def __getattr__(name: str):
    # SpeculativeLM pulls in the inference engine; import it on first use to keep `import specheads` light.
    if name == "SpeculativeLM":
        from specheads.inference.generate import SpeculativeLM

        return SpeculativeLM
    if name == "PromptCache":
        from specheads.inference.prompt_cache import PromptCache

        return PromptCache
    if name == "ChatSession":
        from specheads.inference.chat import ChatSession

        return ChatSession
    if name == "BatchEngine":
        from specheads.inference.batched import BatchEngine

        return BatchEngine
    if name == "CorpusLookup":
        from specheads.inference.corpus_lookup import CorpusLookup

        return CorpusLookup
    if name == "ServingLoop":
        from specheads.inference.serving_loop import ServingLoop

        return ServingLoop
    raise AttributeError(f"module 'specheads' has no attribute {name!r}")
