"""Vision-language targets: a prompt's images (video, audio) reach the target in its first forward only.

A vision-language target (LLaVA, Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM, Mistral 3, ...) merges the
features of its images into the prompt's embeddings in the prompt's forward (the prefill). Every position after
the prompt is text, so the rounds that follow are the text model's, verified exactly as for any causal LM: the heads
read the text model's hidden states, the tree is fed as token ids. Two things differ from a text prompt:

- the extra inputs the processor returns (`pixel_values`, `image_grid_thw`, `mm_token_type_ids`, ...) go to the
  prefill, not to the tree forwards (`prompt_inputs` checks them against the target's forward);
- M-RoPE families (Qwen2-VL and its successors) give an image grid fewer rotary positions than it has tokens, so the
  text after it sits at `cache index + delta` (delta <= 0; the model keeps it as `rope_deltas` after a prefill with
  images, which its own `generate` reads too). Tree nodes must sit there as well (`position_offset`), or the
  verification would see other positions than the target's own decoding and silently emit other tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from specheads.heads.cache_keyword import declared_parameters
from specheads.inference.target_support import unwrapped

# forward arguments the engine sets itself: never taken from a caller's extra inputs
ENGINE_INPUTS = frozenset({
    "input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "inputs_embeds",
    "labels", "logits_to_keep", "output_hidden_states", "output_attentions", "return_dict", "cache_position",
})


def prompt_inputs(target: PreTrainedModel, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`inputs` checked as extra inputs of the target's prompt forward (images and what describes them).

    None values are dropped (a processor may return `image_sizes=None`). Raises a TypeError naming a key that the
    target's forward does not take or a value that is not a tensor, and a ValueError for a key the engine sets
    itself.
    """
    if not inputs:  # a text prompt: the common case, nothing to look up
        return {}
    accepted = declared_parameters(type(unwrapped(target)).forward) - ENGINE_INPUTS
    checked = {}
    for name, value in inputs.items():
        if value is None:
            continue
        if name in ENGINE_INPUTS:
            raise ValueError(f"generate() sets {name!r} itself; it cannot be passed as an extra model input")
        if name not in accepted:
            known = ", ".join(sorted(accepted)) or "none"
            raise TypeError(
                f"generate() got an unknown argument {name!r}: not a generation setting, and "
                f"{type(unwrapped(target)).__name__}.forward takes no such input (its extra inputs: {known})"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model input {name!r} must be a torch.Tensor, got {type(value).__name__}")
        checked[name] = value.to(target.device)  # dtypes as given: target.generate would not cast them either
    return checked


def check_prompt_inputs_call(
    inputs: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    batched: bool | None,
) -> None:
    """Raise a ValueError naming the option that extra model inputs (images) cannot be combined with.

    One prompt at a time: how a batch's images map to its rows is each family's own convention. Its
    `num_return_sequences` copies are decoded one after another, each with the same images.
    """
    if not inputs:
        return
    names = ", ".join(sorted(inputs))
    rows = 1 if input_ids.dim() == 1 else input_ids.shape[0]
    if rows != 1:
        raise ValueError(f"extra model inputs ({names}) need one prompt per call, got batch size {rows}: call generate "
                         "once per prompt")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(f"extra model inputs ({names}) need an unpadded prompt; attention_mask has padding")
    if batched is True:
        raise ValueError(f"batched=True cannot be combined with extra model inputs ({names}): rows sharing images are "
                         "decoded one after another")


def inputs_fingerprint(inputs: dict[str, torch.Tensor]) -> str:
    """A sha256 of a prompt's extra inputs (names, dtypes, shapes and values): a `PromptCache` reuses the entries of
    an image prompt only for a call given the very same images."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(inputs):
        value = inputs[name].detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def image_token_ids(target: PreTrainedModel) -> set[int]:
    """The ids of the tokens a vision-language target replaces by image (or video) features: what a cached prompt's
    continuation must not hold, as it runs without pixel inputs. Empty when the config names none."""
    config = unwrapped(target).config
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return {value for value in (getattr(config, name, None) for name in names) if isinstance(value, int)}


def position_offset(target: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> int:
    """After a prefill with `inputs`: how far the text positions that follow sit from their cache indices.

    0 for text prompts and for targets with one position per token. For M-RoPE targets given an image or video
    grid (the inner model keeps `rope_deltas`, (1, 1), after such a prefill, and transformers' generate reads it
    there too): that delta. Without a grid the model placed the prompt at plain positions and any kept delta is
    another call's.
    """
    if not any(name.endswith("grid_thw") for name in inputs):
        return 0
    inner = getattr(unwrapped(target), "model", None)
    if not hasattr(inner, "get_rope_index"):  # one position per token
        return 0
    deltas = getattr(inner, "rope_deltas", None)
    if deltas is None:  # never guess: text at the wrong positions would silently give other tokens
        raise RuntimeError(f"{type(unwrapped(target)).__name__} was given an image grid but kept no rope_deltas after "
                           "the prompt's forward, so the text positions after the image are unknown")
    return int(deltas.reshape(-1)[0])


def takes_images(target: PreTrainedModel) -> bool:
    """Whether the target is a vision-language model (its config has a `vision_config`: `load_target` loads such a
    checkpoint as its image-text-to-text model)."""
    return getattr(unwrapped(target).config, "vision_config", None) is not None


def image_processor_for(target_name_or_path: str) -> Any | None:
    """The target's processor when it takes images (a vision-language target's), else None.

    `target_name_or_path` is what `load_target` was given (an alias, folder or Hub id); the processor is loaded from
    the folder it resolves to.
    """
    from transformers import AutoProcessor

    from specheads.targets import resolve_target_path

    try:
        processor = AutoProcessor.from_pretrained(resolve_target_path(target_name_or_path))
    except (OSError, ValueError, KeyError, TypeError):  # no processor files, or only a tokenizer's
        return None
    return processor if hasattr(processor, "image_processor") else None


def image_processor_when_asked(rows: list[dict[str, Any]], target_name_or_path: str) -> Any | None:
    """The target's image processor when any prompt row (`prompts.read_prompts`) holds images, else None."""
    return image_processor_for(target_name_or_path) if any(row.get("images") for row in rows) else None


def encode_image_prompt(
    processor: Any, messages: list[dict[str, Any]], images: list[Any], chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict]:
    """(input_ids (1, n), the extra model inputs) of chat `messages` whose contents list `{"type": "image"}` and
    `{"type": "text", "text": ...}` parts, the images (PIL) in their order; the assistant's turn opened (with
    `chat_template` instead of the processor's when given; `template_kwargs`: the template's keywords)."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template,
                                         **(template_kwargs or {}))
    encoded = dict(processor_encode(processor, text, images, return_tensors="pt"))
    input_ids = encoded.pop("input_ids")
    encoded.pop("attention_mask", None)  # one unpadded prompt: all ones
    return input_ids, encoded


def processor_encode(processor: Any, text: str, images: list[Any], **kwargs: Any) -> Any:
    """The processor's encoding of one `text` with its `images`, special tokens added as transformers' processors
    add them to a rendered chat (`ProcessorMixin.apply_chat_template`): the tokenizer's, unless the text already
    starts with its BOS token (a template that writes BOS itself would otherwise get two)."""
    bos = processor.tokenizer.bos_token
    if bos is not None and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    return processor(text=[text], images=images or None, **kwargs)


def load_images(images: list[Any]) -> list[Any]:
    """RGB PIL images of `images`: file paths (a FileNotFoundError lists the missing ones), PIL images, or a `datasets`
    Image column's `{"bytes", "path"}` dicts."""
    import io
    from pathlib import Path

    try:
        from PIL import Image
    except ImportError as err:
        raise ImportError("reading images needs Pillow: pip install 'specheads[vision]'") from err
    paths = [image for image in images if isinstance(image, (str, Path))]
    missing = [str(path) for path in paths if not Path(path).is_file()]
    if missing:
        raise FileNotFoundError(f"image file(s) {missing} do not exist")
    opened = []
    for image in images:
        if isinstance(image, dict):
            image = io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"]
        opened.append((image if isinstance(image, Image.Image) else Image.open(image)).convert("RGB"))
    return opened


def prompt_with_images(
    processor: Any, text: str, images: list[Any], chat: bool | None = None, template_kwargs: dict[str, Any] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(input_ids (1, n), extra model inputs) of one user turn holding `images` (PIL), then `text`, written with the
    processor's chat template (`chat=False`: the processor's image token per image, then the text, no template;
    None: the template when the processor has one)."""
    use_chat = bool(getattr(processor, "chat_template", None)) if chat is None else chat
    if use_chat:
        if not getattr(processor, "chat_template", None):
            raise ValueError(f"the target's processor ({type(processor).__name__}) has no chat template; use no chat "
                             "template (--no-chat)")
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        return encode_image_prompt(processor, [{"role": "user", "content": content}], images,
                                   template_kwargs=template_kwargs)
    if not getattr(processor, "image_token", None):
        raise ValueError(f"the target's processor ({type(processor).__name__}) names no image token for a prompt "
                         "without the chat template; use the chat template")
    encoded = dict(processor_encode(processor, processor.image_token * len(images) + text, images, return_tensors="pt"))
    encoded.pop("attention_mask", None)
    return encoded.pop("input_ids"), encoded


def image_prompt(
    target_name_or_path: str, text: str, image_paths: list[str], chat: bool | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """A prompt with images for a vision-language target, made by the target's processor (`prompt_with_images`).

    Args:
        target_name_or_path: what `load_target` was given (an alias, folder or Hub id).
        text: the question.
        image_paths: image files (anything Pillow opens).
        chat: apply the chat template (default: when the processor has one).
        template_kwargs: the chat template's keywords (`enable_thinking=False`, ...).

    Returns:
        (input_ids (1, n), the extra model inputs for `generate` (`pixel_values`, ...), the processor).

    Raises:
        FileNotFoundError: an image file is missing. ValueError: the target ships no image processor, or the prompt
            needs a chat template the processor lacks.
    """
    images = load_images(image_paths)
    processor = image_processor_for(target_name_or_path)
    if processor is None:
        raise ValueError(f"target {target_name_or_path!r} ships no processor that takes images; expected a "
                         "vision-language target (LLaVA, Qwen2-VL, Gemma 3, Idefics3, ...)")
    return (*prompt_with_images(processor, text, images, chat, template_kwargs), processor)
