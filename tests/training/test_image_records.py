"""Training records with images, for vision-language targets: tokenized by the target's processor (image tokens
expanded, never trained), their images read by the target while it makes the features, in one forward per image
row. Tested on the LLaVA built around stories260K (`story_vlm_dir`), against the target's own forward and against
the prompt `specheads generate --image` makes."""

from __future__ import annotations

import base64
import io
import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from specheads import load_target
from specheads.inference.multimodal import prompt_with_images
from specheads.training.conversations import conversation_segments, to_messages
from specheads.training.data import build_dataset, collate
from specheads.training.features import OfflineFeatures, dataset_sha256, dump_features, target_states
from specheads.training.image_records import ImageCollate, has_image_rows, image_conversation

IMAGE_TOKENS = 16  # the story LLaVA's (16 / 4)^2 patches


def save_image(path, seed: int) -> str:
    pixels = (np.random.default_rng(seed).random((16, 16, 3)) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.fixture(scope="module")
def story_vlm(story_vlm_dir):
    target, tokenizer = load_target(story_vlm_dir)
    return target, tokenizer, AutoProcessor.from_pretrained(story_vlm_dir)


@pytest.fixture()
def image_chats(tmp_path):
    """Two sources (a mixture): ShareGPT conversations, one with an image (relative path, LLaVA's `<image>`
    placeholder) and one text-only; an OpenAI conversation whose content list names its image. Rows: image, text,
    image."""
    save_image(tmp_path / "a.png", 0)
    save_image(tmp_path / "b.png", 1)
    sharegpt = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nOnce upon a time"},
                                             {"from": "gpt", "value": " there was a little girl named Lily."}]},
        {"conversations": [{"from": "human", "value": "Once upon a time"},
                           {"from": "gpt", "value": " there was a big dog."}]},
    ]
    openai = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "b.png"},
                                                         {"type": "text", "text": "One day"}]},
                            {"role": "assistant", "content": " Tom went to the park to play."}]}]
    paths = [tmp_path / "llava.jsonl", tmp_path / "openai.jsonl"]
    for path, records in zip(paths, (sharegpt, openai)):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


IMAGE_ROWS = (0, 2)
ANSWERS = (" there was a little girl named Lily.", " there was a big dog.", " Tom went to the park to play.")


def test_image_conversation_places_images_where_the_record_says(tmp_path):
    a, b = save_image(tmp_path / "a.png", 0), save_image(tmp_path / "b.png", 1)
    llava = {"images": [a, b], "conversations": [{"from": "human", "value": "<image>\nLeft <image> right"},
                                                 {"from": "gpt", "value": "Two cats."}]}
    messages, refs = image_conversation(llava, "sharegpt")
    assert messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Left"}, {"type": "image"},
                                      {"type": "text", "text": "right"}]
    assert messages[1]["content"] == [{"type": "text", "text": "Two cats."}] and refs == [a, b]
    # without placeholders the images open the first user turn (as `generate --image` places them)
    plain = {"image": "a.png", "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "What is it?"},
                                            {"role": "assistant", "content": "A cat."}]}
    messages, refs = image_conversation(plain, "openai", tmp_path)
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is it?"}] and refs == [a]
    # an image given inline as a data: URL becomes its bytes
    png = io.BytesIO()
    Image.open(a).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    inline = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                           {"role": "assistant", "content": "A cat."}]}
    assert image_conversation(inline, "openai")[1] == [{"bytes": png.getvalue(), "path": None}]


@pytest.mark.parametrize("record, message", [
    ({"images": ["a.png"], "conversations": [{"from": "human", "value": "<image> and <image>"},
                                             {"from": "gpt", "value": "x"}]}, "place more images"),
    ({"images": ["a.png", "a.png"], "conversations": [{"from": "human", "value": "<image> only one"},
                                                      {"from": "gpt", "value": "x"}]}, r"lists 2 image\(s\) but its turns place 1"),
    ({"image": "a.png", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}]},
     "assistant turn holds an image"),
    ({"image": "gone.png", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
     "gone.png' does not exist"),
])
def test_image_conversation_refuses_what_it_cannot_place(tmp_path, record, message):
    save_image(tmp_path / "a.png", 0)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        image_conversation(record, "sharegpt", tmp_path)


def test_image_records_are_tokenized_with_their_image_tokens(story_vlm, image_chats):
    target, tokenizer, processor = story_vlm
    dataset = build_dataset(image_chats, tokenizer, max_length=128, processor=processor)
    assert has_image_rows(dataset) and dataset.column_names == ["input_ids", "loss_mask", "length", "images", "image_pieces"]
    image_id = target.config.image_token_id
    for i, answer in enumerate(ANSWERS):
        row = dataset[i]
        ids, mask = row["input_ids"], row["loss_mask"]
        with_image = i in IMAGE_ROWS
        assert ids.count(image_id) == IMAGE_TOKENS * with_image and len(row["images"]) == with_image
        trained = [t for t, m in zip(ids, mask) if m]  # the answer, and only the answer, is trained
        assert trained == tokenizer(answer, add_special_tokens=False).input_ids
        assert all(m == 0 for t, m in zip(ids, mask) if t == image_id)
        if with_image:  # transformers' own tokens of the whole conversation (answers that merge with no prompt token)
            record = [json.loads(line) for source in image_chats for line in source.read_text().splitlines()][i]
            messages = image_conversation(record, "sharegpt" if "conversations" in record else "openai",
                                          image_chats[0].parent)[0]
            whole = processor.apply_chat_template(messages, tokenize=True, return_dict=True, images=row["images"])
            assert list(whole["input_ids"][0]) == ids
    # the prompt part is what `generate --image` feeds the target for the same question and image
    prompt_ids, prompt_inputs = prompt_with_images(processor, "Once upon a time", [dataset[0]["images"][0].convert("RGB")])
    answer_start = dataset[0]["loss_mask"].index(1)
    assert prompt_ids[0].tolist() == dataset[0]["input_ids"][:answer_start]
    inputs = ImageCollate(processor).row_inputs(dataset[0])
    assert torch.equal(inputs["pixel_values"], prompt_inputs["pixel_values"])


def test_text_target_trains_image_records_as_text_with_a_warning(image_chats, target_and_tokenizer, caplog):
    _, tokenizer = target_and_tokenizer
    with caplog.at_level(logging.WARNING):
        dataset = build_dataset(image_chats, tokenizer, max_length=128)
    assert "1 of 2 records hold images, which training does not read (the target takes no images" in caplog.text
    assert "1 of 1 records hold images" in caplog.text
    assert not has_image_rows(dataset) and len(dataset) == 3


def test_records_whose_images_do_not_fit_are_left_out(story_vlm, image_chats, caplog):
    _, tokenizer, processor = story_vlm
    with caplog.at_level(logging.WARNING):
        dataset = build_dataset(image_chats[0], tokenizer, max_length=IMAGE_TOKENS, processor=processor)
    assert "left out 1 records whose images do not fit in data.max_length=16 tokens" in caplog.text
    assert len(dataset) == 1 and not has_image_rows(dataset)  # the text record is left
    with pytest.raises(ValueError, match="every record was left out, their images do not fit in data.max_length=16"):
        build_dataset(image_chats[1], tokenizer, max_length=IMAGE_TOKENS, processor=processor)


def test_segments_of_text_records_are_unchanged_by_content_lists(target_and_tokenizer):
    _, tokenizer = target_and_tokenizer
    as_list = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    parts = to_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                      {"role": "assistant", "content": "Hello."}]}, "openai")
    assert parts == as_list
    assert conversation_segments(tokenizer, parts) == [("user: Hi\n", False), ("assistant: ", False),
                                                       (f"Hello.{tokenizer.eos_token}\n", True)]


def test_target_states_read_each_rows_image(story_vlm, image_chats):
    """A batch of image and text rows: each row's hidden states are the target's own forward of that row alone (with
    its image), and another image gives other states (the image is read, not dropped)."""
    target, tokenizer, processor = story_vlm
    dataset = build_dataset(image_chats, tokenizer, max_length=128, processor=processor)
    rows = [dataset[i] for i in range(3)]
    batch = ImageCollate(processor)(rows, pad_token_id=0)
    assert [inputs is None for inputs in batch["row_inputs"]] == [False, True, False]
    states, logits = target_states(target, batch["input_ids"], batch["attention_mask"], batch["row_inputs"])
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        alone = target(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True,
                       **(batch["row_inputs"][i] or {}))
        torch.testing.assert_close(states[-1][i, :n], alone.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[i, :n], alone.logits[0], rtol=1e-5, atol=1e-5)
        if i in IMAGE_ROWS:  # run alone, unpadded: its padding positions are zeros
            assert not states[-1][i, n:].any()
    other = {**batch["row_inputs"][0], "pixel_values": batch["row_inputs"][2]["pixel_values"]}
    swapped, _ = target_states(target, batch["input_ids"][:1], batch["attention_mask"][:1], [other])
    assert not torch.allclose(swapped[-1][0], states[-1][0], atol=1e-4)


def test_feature_dump_of_image_rows_holds_the_image_conditioned_features(story_vlm, image_chats, tmp_path):
    target, tokenizer, processor = story_vlm
    dataset = build_dataset(image_chats, tokenizer, max_length=128, processor=processor)
    layer = target.config.get_text_config().num_hidden_layers
    with pytest.raises(ValueError, match="needs the target's processor"):
        dump_features(target, dataset, tmp_path / "none", layer, show_progress=False)
    dump_features(target, dataset, tmp_path / "dump", layer, batch_size=3, show_progress=False, processor=processor)
    dumped = OfflineFeatures(tmp_path / "dump")
    batch = ImageCollate(processor)([dataset[i] for i in range(3)])
    states, _ = target_states(target, batch["input_ids"], batch["attention_mask"], batch["row_inputs"])
    for i in range(3):
        n = len(dataset[i]["input_ids"])
        assert dumped[i]["input_ids"] == dataset[i]["input_ids"]
        torch.testing.assert_close(dumped[i]["features"], states[layer][i, :n])
    # the data's hash covers the images: another picture under the same name is other data
    before = dataset_sha256(dataset)
    save_image(image_chats[0].parent / "a.png", 7)
    assert dataset_sha256(dataset) != before


def test_relative_image_paths_resolve_against_image_folder(story_vlm, tmp_path):
    _, tokenizer, processor = story_vlm
    (tmp_path / "pictures").mkdir()
    save_image(tmp_path / "pictures" / "cat.png", 3)
    record = {"image": "cat.png", "conversations": [{"from": "human", "value": "<image>\nOnce"},
                                                    {"from": "gpt", "value": " upon a time there was a cat."}]}
    data = tmp_path / "chats.json"
    data.write_text(json.dumps([record]))
    with pytest.raises(FileNotFoundError, match=r"record 0: image file .*/cat.png' does not exist"):
        build_dataset(data, tokenizer, max_length=64, processor=processor)
    dataset = build_dataset(data, tokenizer, max_length=64, processor=processor, image_folder=tmp_path / "pictures")
    assert len(dataset[0]["images"]) == 1


def test_regenerate_without_processor_and_medusa2_refuse_image_records(story_vlm, story_vlm_dir, image_chats, stories_file, tmp_path):
    from specheads.training.config import load_run_config
    from specheads.training.data_cli import regenerate
    from specheads.training.train import train

    from .conftest import CONFIGS, overrides

    target, tokenizer, _ = story_vlm
    with pytest.raises(ValueError, match="record 0: holds images, but the target takes none"):
        regenerate(target, tokenizer, tmp_path / "out.jsonl", input_path=image_chats[0], show_progress=False)
    extra = {"target": str(story_vlm_dir), "data.source": str(image_chats[0]), "data.format": "auto", "max_steps": 2}
    config = load_run_config(str(CONFIGS / "medusa2_stories260k.yaml"), overrides(stories_file, tmp_path / "run", **extra))
    with pytest.raises(ValueError, match="joint.enabled=true .* the data holds records with images"):
        train(config)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3"])
def test_target_states_of_every_family_equal_its_own_forward(tiny_vlm_factory, family):
    """An image row beside a longer text row (so the image row is padded in the batch): each row's states are the
    family's own forward of it (M-RoPE positions, Gemma 3's bidirectional image attention, Idefics3's 5-D pixels)."""
    target, ids, inputs = tiny_vlm_factory(family)
    text = torch.arange(3, 3 + ids.shape[1] + 5)[None]  # plain tokens, 5 longer than the image row
    input_ids = torch.zeros(2, text.shape[1], dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    input_ids[0, : ids.shape[1]], attention_mask[0, : ids.shape[1]] = ids[0], 1
    input_ids[1], attention_mask[1] = text[0], 1
    states, logits = target_states(target, input_ids, attention_mask, [inputs, None])
    alone = target(input_ids=ids, **inputs, output_hidden_states=True)
    torch.testing.assert_close(states[-1][0, : ids.shape[1]], alone.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0, : ids.shape[1]], alone.logits[0], rtol=1e-5, atol=1e-5)
    text_alone = target(input_ids=text, output_hidden_states=True)
    torch.testing.assert_close(states[-1][1], text_alone.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


def test_per_token_inputs_are_cut_to_a_truncated_row(story_vlm, image_chats):
    """A processor that returns per-token inputs (as Gemma 3's `token_type_ids`, Qwen's `mm_token_type_ids`): a row
    truncated to data.max_length gets them cut to its length."""
    target, tokenizer, processor = story_vlm

    class WithTokenTypes:  # the story LLaVA's processor, plus Gemma 3's per-token image mask
        tokenizer, chat_template, image_token = processor.tokenizer, processor.chat_template, processor.image_token

        def __call__(self, **kwargs):
            encoded = processor(**kwargs)
            ids = torch.as_tensor(encoded["input_ids"])
            encoded["token_type_ids"] = (ids == target.config.image_token_id).long()
            return encoded

        def apply_chat_template(self, *args, **kwargs):
            return processor.apply_chat_template(*args, **kwargs)

    full = build_dataset(image_chats[0], tokenizer, max_length=128, processor=processor)[0]
    cut = build_dataset(image_chats[0], tokenizer, max_length=len(full["input_ids"]) - 3, processor=WithTokenTypes())[0]
    inputs = ImageCollate(WithTokenTypes()).row_inputs(cut)
    assert inputs["token_type_ids"].shape == (1, len(cut["input_ids"])) == (1, len(full["input_ids"]) - 3)
    assert inputs["token_type_ids"].sum() == IMAGE_TOKENS and inputs["pixel_values"].shape == (1, 3, 16, 16)


def test_regenerate_answers_image_records_seeing_their_images(story_vlm, image_chats, tmp_path):
    """The target answers each record with images given its images (greedy: its own `generate` on the prompt
    `generate --image` makes), text records in one batch; the output keeps the images and trains as image records."""
    from specheads.training.data_cli import regenerate

    target, tokenizer, processor = story_vlm
    outs = [tmp_path / "answers.jsonl", tmp_path / "answers_openai.jsonl"]
    for source, out in zip(image_chats, outs):
        regenerate(target, tokenizer, out, input_path=source, max_new_tokens=12, temperature=0.0, show_progress=False,
                   processor=processor)
    records = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    assert [len(r.get("images", [])) for r in records] == [1, 0, 1]
    assert records[0]["images"][0] == str(image_chats[0].parent / "a.png")
    for record, question in ((records[0], "Once upon a time"), (records[2], "One day")):
        ids, inputs = prompt_with_images(processor, question, [Image.open(record["images"][0]).convert("RGB")])
        expected = target.generate(input_ids=ids, **inputs, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert record["messages"][-1]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    dataset = build_dataset(outs, tokenizer, max_length=128, processor=processor)  # written as it reads back
    assert has_image_rows(dataset) and [len(dataset[i]["images"]) for i in range(3)] == [1, 0, 1]
    with pytest.raises(FileNotFoundError, match="record 0: .*does not exist"):
        regenerate(target, tokenizer, tmp_path / "x.jsonl", input_path=image_chats[0], processor=processor,
                   image_folder=tmp_path / "elsewhere", show_progress=False)


def test_images_in_two_user_turns(story_vlm, tmp_path):
    """A conversation that shows a second image after the first answer: both answers trained, both images read in
    order (the row's states are the target's forward with both)."""
    target, tokenizer, processor = story_vlm
    a, b = save_image(tmp_path / "a.png", 0), save_image(tmp_path / "b.png", 1)
    record = {"images": [a, b], "conversations": [
        {"from": "human", "value": "<image>\nOnce upon a time"}, {"from": "gpt", "value": " there was a cat."},
        {"from": "human", "value": "<image>\nThen"}, {"from": "gpt", "value": " a dog came."}]}
    (tmp_path / "two.json").write_text(json.dumps([record]))
    dataset = build_dataset(tmp_path / "two.json", tokenizer, max_length=128, processor=processor)
    row = dataset[0]
    assert row["input_ids"].count(target.config.image_token_id) == 2 * IMAGE_TOKENS
    trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert trained == tokenizer(" there was a cat.", add_special_tokens=False).input_ids + \
        tokenizer(" a dog came.", add_special_tokens=False).input_ids
    inputs = ImageCollate(processor).row_inputs(row)
    assert inputs["pixel_values"].shape == (2, 3, 16, 16)
    images = [image.convert("RGB") for image in row["images"]]
    expected = processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(inputs["pixel_values"], expected)
    batch = ImageCollate(processor)([row])
    states, _ = target_states(target, batch["input_ids"], batch["attention_mask"], batch["row_inputs"])
    alone = target(input_ids=torch.tensor([row["input_ids"]]), pixel_values=expected, output_hidden_states=True)
    torch.testing.assert_close(states[-1][0], alone.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


def test_eval_scores_heads_on_image_records(story_vlm, story_vlm_dir, image_chats, tmp_path, capsys):
    """`specheads eval --data` on a vision-language target reads the records' images (the same scores as the
    training loss computes on `ImageCollate` batches)."""
    from specheads import create_heads
    from specheads.cli import main
    from specheads.training.config import RunConfig
    from specheads.training.evaluate import evaluate
    from specheads.training.train import compute_loss

    target, tokenizer, processor = story_vlm
    torch.manual_seed(0)
    heads = create_heads(target, "eagle").eval()
    heads.save_pretrained(tmp_path / "heads")
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--data",
                 str(image_chats[0]), "--out", str(out)]) == 0
    scored = json.loads(out.read_text())
    dataset = build_dataset(image_chats[0], tokenizer, max_length=768, processor=processor)
    config = RunConfig(target=str(story_vlm_dir))
    config.loss.input_noise = 0.0
    expected = evaluate(lambda batch: compute_loss(config, heads, heads, target, batch, []), dataset,
                        ImageCollate(processor), 4, target.device, progress=False)
    assert scored["examples"] == 2 and scored["tokens"] == expected["tokens"]
    assert scored["loss"] == pytest.approx(expected["loss"], abs=1e-4)
    as_text = build_dataset(image_chats[0], tokenizer, max_length=768)  # the same records, their images unread
    blind = evaluate(lambda batch: compute_loss(config, heads, heads, target, batch, []), as_text,
                     lambda rows: collate(rows), 4, target.device, progress=False)
    assert abs(blind["loss"] - scored["loss"]) > 1e-3
