"""Training records that hold images: a vision-language target sees them while it makes the heads' features.

At inference the heads draft after a prompt whose images the target read (`inference/multimodal.py`), so the
features they read are image-conditioned; trained on the text alone they would learn other features. A record
holds its images as `image` (one) or `images` (a list): file paths (relative to the data file's folder, or to
`data.image_folder`), a dataset's Image column, `{"bytes", "path"}` dicts or `data:` URLs. `<image>` placeholders
in its turns say where they go (LLaVA-Instruct, ShareGPT4V); a turn's content may also be a list of parts
(`{"type": "image"}`, which may name its own image under "image" / "path" / "url", and `{"type": "text",
"text": ...}`). Without placeholders the images open the first user turn, as `specheads generate --image` places them.

The target's processor writes the conversation (its chat template) and expands each image into the image tokens
the target's forward expects, so the token ids are those of inference; the loss mask trains the assistant turns
only. Batches re-make the pixel inputs from the stored images (`ImageCollate`): a dataset keeps image paths or
encoded bytes, never pixel tensors.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import torch

from specheads.inference.multimodal import load_images, processor_encode
from specheads.training.conversations import conversation_spans, record_template_kwargs, to_messages
from specheads.training.data import collate

IMAGE_PLACEHOLDER = "<image>"
IMAGE_COLUMNS = ("images", "image_pieces")  # a tokenized dataset with image records has these two columns too


def has_images(record: dict[str, Any]) -> bool:
    """Whether a record names images (an `image` / `images` field, or image parts in its turns)."""
    if record.get("image") is not None or record.get("images"):
        return True
    turns = record.get("messages") or record.get("conversations") or []
    return any(isinstance(turn, dict) and isinstance(turn.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") in ("image", "image_url") for part in turn["content"])
               for turn in turns)


def image_conversation(
    record: dict[str, Any], fmt: str, image_folder: Path | None = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages whose contents are lists of `{"type": "image"}` / `{"type": "text", "text"}` parts, the images in
    the order of their parts) of a ShareGPT or OpenAI record that holds images.

    Raises:
        ValueError: placeholders and images disagree in number, or an assistant turn holds an image.
    """
    listed = record.get("images", record.get("image"))
    listed = [] if listed is None else list(listed) if isinstance(listed, (list, tuple)) else [listed]
    pending = [ref for ref in listed if ref is not None]
    raw = [turn.get("value", "") for turn in record["conversations"]] if fmt == "sharegpt" else \
        [turn["content"] for turn in record["messages"]]
    refs: list[Any] = []
    messages = []
    for message, content in zip(to_messages(record, fmt), raw):
        parts = _content_parts("" if content is None else content, pending, refs)  # None: a turn that only calls tools
        if message["role"] == "assistant" and any(part["type"] == "image" for part in parts):
            raise ValueError("an assistant turn holds an image; images must be in the user's (or system's) turns")
        messages.append({**message, "content": parts})  # its other fields (tool_calls, ...) as they are
    if not refs and pending:  # no placeholders: the images open the first user turn
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError(f"the record holds {len(pending)} image(s) but no user turn to put them in")
        first_user["content"][:0] = [{"type": "image"} for _ in pending]
        refs, pending = pending, []
    if pending:
        raise ValueError(f"the record lists {len(listed)} image(s) but its turns place {len(refs)} "
                         f"({IMAGE_PLACEHOLDER!r} placeholders or image parts); expected one place per image")
    return messages, [_resolved(ref, image_folder) for ref in refs]


def _content_parts(content: Any, pending: list[Any], refs: list[Any]) -> list[dict[str, Any]]:
    """One turn's content as parts; each image part takes its own image or the next of `pending` (into `refs`)."""
    def image_part(own: Any = None) -> dict[str, Any]:
        if own is None:
            if not pending:
                raise ValueError("the record's turns place more images (placeholders or image parts) than it lists")
            own = pending.pop(0)
        refs.append(own)
        return {"type": "image"}

    if isinstance(content, str):
        pieces = content.split(IMAGE_PLACEHOLDER)
        if len(pieces) == 1:  # no placeholder: the text as it is
            return [{"type": "text", "text": content}] if content else []
        parts: list[dict[str, Any]] = []
        for k, piece in enumerate(pieces):  # "<image>\nWhat is this?": the image, then "What is this?"
            if k:
                parts.append(image_part())
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        return parts
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image":
            parts.append(image_part(part.get("image", part.get("path", part.get("url")))))
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append(image_part(url.get("url") if isinstance(url, dict) else url))
        else:
            raise ValueError(f"a content part of type {kind!r}; expected 'text', 'image' or 'image_url'")
    return parts


def _resolved(ref: Any, image_folder: Path | None) -> Any:
    """An image reference the `datasets` Image feature stores: an absolute file path, `{"bytes", "path"}`, or a PIL
    image; a `data:` URL becomes its bytes. A missing file is a FileNotFoundError naming it."""
    if isinstance(ref, str):
        if ref.startswith("data:"):
            return {"bytes": base64.b64decode(ref.split(",", 1)[-1]), "path": None}
        path = Path(ref)
        if not path.is_absolute() and image_folder is not None:
            path = image_folder / path
        if not path.is_file():
            raise FileNotFoundError(f"image file {str(path)!r} does not exist (relative image paths are read from the "
                                    "data file's folder, or from data.image_folder / --image-folder)")
        return str(path.resolve())
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):
        return {"bytes": ref.get("bytes"), "path": ref.get("path")}
    if hasattr(ref, "convert"):  # a PIL image (a dataset's decoded Image column)
        return ref
    raise ValueError(f"an image given as {type(ref).__name__}; expected a file path, a data: URL, a PIL image or "
                     "a {'bytes', 'path'} dict")


def tokenize_image_record(
    processor: Any, record: dict[str, Any], fmt: str, max_length: int, image_folder: Path | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Token ids, loss mask, images and image pieces of one record with images, or None when its images do not fit in
    `max_length` tokens (cut inside an image, the target's forward would fail).

    The conversation is tokenized piece by piece (`conversation_spans`), as text records are (`tokenize_record`), a
    piece that writes images by the processor with those images (it expands each into its image tokens) and the
    others by the tokenizer; special tokens go where the processor puts them on a whole chat (`processor_encode`).
    The image pieces (`image_pieces`, JSON: where each starts, its text, its number of images, whether it opens
    the conversation) are what `ImageCollate` encodes again for every batch. `template_kwargs`: the chat template's
    keywords.
    """
    messages, refs = image_conversation(record, fmt, image_folder)
    images = load_images(refs)
    tokenizer = processor.tokenizer
    if getattr(processor, "chat_template", None):
        spans = conversation_spans(processor, messages, record_template_kwargs(record, template_kwargs))
    else:  # "role: text" lines, the processor's image token where each image goes (as `generate --no-chat`)
        flat = [{"role": m["role"], "content": "".join(processor.image_token if p["type"] == "image" else p["text"]
                                                        for p in m["content"])} for m in messages]
        bos = [(tokenizer.bos_token, False, range(0))] if tokenizer.bos_token else []
        spans = bos + conversation_spans(tokenizer, flat)
    per_message = [sum(part["type"] == "image" for part in m["content"]) for m in messages]
    ids: list[int] = []
    mask: list[int] = []
    pieces: list[dict[str, Any]] = []
    used = 0
    for number, (text, trained, covered) in enumerate(spans):
        count = sum(per_message[i] for i in covered)
        opens = number == 0  # the only piece that may get the tokenizer's special tokens (BOS)
        piece = processor_encode(processor, text, images[used: used + count],
                                 **({} if opens else {"add_special_tokens": False}))["input_ids"][0]
        if count:
            pieces.append({"start": len(ids), "text": text, "images": count, "opens": opens})
            used += count
            if len(ids) + len(piece) > max_length:
                return None
        ids += piece
        mask += [int(trained)] * len(piece)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "images": refs,
            "image_pieces": json.dumps(pieces)}


class ImageCollate:
    """`collate`, plus for each row with images its extra inputs of the target's forward (`row_inputs`: a list with
    a dict of tensors per image row, None per text row), made by the processor from the row's stored images."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, rows: list[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
        batch: dict[str, Any] = collate(rows, pad_token_id)
        batch["row_inputs"] = [self.row_inputs(row) if row.get("images") else None for row in rows]
        return batch

    def row_inputs(self, row: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The processor's inputs for one row other than its tokens: per-token ones (`token_type_ids`, ...) laid over
        the whole row (0 on text pieces), the others (`pixel_values`, `image_grid_thw`, ...) of every image piece
        concatenated in order (image-major, as LLaVA, Qwen2-VL and Gemma 3 take several images).

        Raises:
            ValueError: the processor now tokenizes a piece other than when the dataset was made.
        """
        images, used, n = load_images(row["images"]), 0, len(row["input_ids"])
        per_token: dict[str, torch.Tensor] = {}
        others: dict[str, list[torch.Tensor]] = {}
        for piece in json.loads(row["image_pieces"]):
            encoded = dict(processor_encode(self.processor, piece["text"], images[used: used + piece["images"]],
                                            return_tensors="pt", **({} if piece["opens"] else {"add_special_tokens": False})))
            used += piece["images"]
            ids, start = encoded.pop("input_ids")[0], piece["start"]
            encoded.pop("attention_mask", None)
            if ids.tolist() != list(row["input_ids"][start: start + len(ids)]):
                raise ValueError("the processor's tokens of an image row differ from the dataset's: the dataset was "
                                 "made with another processor; tokenize it again")
            for name, value in encoded.items():
                if value is None:
                    continue
                if value.dim() == 2 and value.shape == (1, len(ids)):  # one value per token
                    whole = per_token.setdefault(name, value.new_zeros(1, n))
                    whole[:, start: start + len(ids)] = value
                else:
                    others.setdefault(name, []).append(value)
        return {**per_token, **{name: torch.cat(values) if len(values) > 1 else values[0]
                                for name, values in others.items()}}


def has_image_rows(dataset: Any) -> bool:
    """Whether a tokenized dataset holds rows with images (it has the `IMAGE_COLUMNS`)."""
    return all(column in getattr(dataset, "column_names", ()) for column in IMAGE_COLUMNS)


def collate_for(dataset: Any, processor: Any) -> Any:
    """The collate function of a tokenized dataset: `ImageCollate` when it holds image rows, else `collate`."""
    return ImageCollate(processor) if has_image_rows(dataset) else collate


def image_prompt_of(
    processor: Any, record: dict[str, Any], fmt: str, keep: list[int], image_folder: Path | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[str], torch.Tensor, dict[str, torch.Tensor]]:
    """A prompt for the target to answer (`data regenerate`) from the turns `keep` of a record with images.

    Returns:
        (the kept turns as messages with image parts, their images as JSON strings (file paths, or `data:` URLs for
        images held in the data), input_ids (1, n), the prompt forward's extra inputs (`pixel_values`, ...)).
    """
    from specheads.inference.multimodal import encode_image_prompt

    messages, refs = image_conversation(record, fmt, image_folder)
    owners = [i for i, m in enumerate(messages) for part in m["content"] if part["type"] == "image"]  # per image
    kept_refs = [ref for ref, owner in zip(refs, owners) if owner in keep]
    input_ids, inputs = encode_image_prompt(processor, [messages[i] for i in keep], load_images(kept_refs),
                                            template_kwargs=template_kwargs)
    return [messages[i] for i in keep], [_json_ref(ref) for ref in kept_refs], input_ids, inputs


def _json_ref(ref: Any) -> str:
    """A `_resolved` image reference as a JSON string: its path, or a `data:` URL of its bytes."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, dict) and not ref.get("bytes"):
        return str(ref["path"])
    if isinstance(ref, dict):
        data = ref["bytes"]
    else:  # a PIL image
        buffer = io.BytesIO()
        ref.save(buffer, format="PNG")
        data = buffer.getvalue()
    from PIL import Image

    kind = (Image.open(io.BytesIO(data)).format or "png").lower()
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()
