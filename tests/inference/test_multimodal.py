"""Vision-language targets (inference/multimodal.py): the prompt's images reach the prefill only, every later
position is text; greedy output is the target's own `generate` with the same images, sampling reads the target's
exact conditionals, and M-RoPE targets (Qwen2-VL, Qwen2.5-VL) get their tree nodes at the shifted text positions.

Tiny random targets of five families (`tests/conftest.py` build_tiny_vlm) and a LLaVA around stories260K with a
processor (`story_vlm_dir`) for `load_target`, the CLI's `--image` and `custom_generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from specheads import HEAD_TYPES, SpeculativeLM, create_heads, load_heads, load_target
from specheads.cli import main
from specheads.inference.batched import BatchEngine
from specheads.inference.custom_generate import export_for_transformers
from specheads.inference.multimodal import image_prompt, position_offset
from specheads.inference.prompt_cache import PromptCache

from ..conftest import VLM_FAMILIES, VLM_IMAGE


def target_greedy(target, ids, inputs, max_new_tokens: int) -> torch.Tensor:
    return target.generate(input_ids=ids, **inputs, max_new_tokens=max_new_tokens, do_sample=False)


def heads_for(target, head_type: str):
    torch.manual_seed(0)
    return create_heads(target, head_type).eval()


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_image_prompts_give_the_targets_own_greedy_output(tiny_vlm_factory, family, head_type):
    target, ids, inputs = tiny_vlm_factory(family)
    expected = target_greedy(target, ids, inputs, 40)
    lm = SpeculativeLM(target, heads_for(target, head_type), lookup_tokens=8)  # lookup: multi-token paths too
    assert torch.equal(lm.generate(ids, max_new_tokens=40, **inputs), expected)
    if family != "gemma3":  # (Gemma 3 needs its token_type_ids with images) the images do change the answer
        assert not torch.equal(target_greedy(target, ids, {}, 40), expected)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_oracle_drafts_accept_long_paths_after_an_image(tiny_vlm_factory, oracle_drafter, family):
    """Mostly-right drafts after an image: long accepted paths, rejections, rescued siblings; output identical.
    On M-RoPE targets the nodes sit at the text positions the image shifted (a nonzero offset, which matters)."""
    target, ids, inputs = tiny_vlm_factory(family)
    n = 60
    expected = target_greedy(target, ids, inputs, n)
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    lm.drafter = oracle_drafter(expected[0].tolist() + [1] * 8, target.config.get_text_config().vocab_size, depth=5,
                                corruption_rate=0.15, cycle_rejections=True, seed=3)
    assert torch.equal(lm.generate(ids, max_new_tokens=n, **inputs), expected)
    lm.drafter.check_accepted()
    assert lm.last_stats["mean_accepted"] > 2.5
    offset = position_offset(target, inputs)
    assert (offset == -12) if family.startswith("qwen") else (offset == 0)  # 16 image tokens on 4 positions


def test_a_wrong_text_offset_would_change_the_output(tiny_vlm_factory, monkeypatch):
    """The M-RoPE test above can fail: with the nodes at their cache indices the tokens differ."""
    import specheads.inference.verify as verify

    target, ids, inputs = tiny_vlm_factory("qwen2_vl")
    expected = target_greedy(target, ids, inputs, 40)
    monkeypatch.setattr(verify, "text_position_offset", lambda *args: 0)
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    assert not torch.equal(lm.generate(ids, max_new_tokens=40, **inputs), expected)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_sampled_tokens_follow_the_targets_conditionals_given_the_image(tiny_vlm_factory, family):
    """Sampling (3 sequences of one prompt, decoded one after another, each with the image): the logits every token
    was drawn from are the target's own at that position, from one forward over the image and the whole sequence."""
    target, ids, inputs = tiny_vlm_factory(family)
    lm = SpeculativeLM(target, heads_for(target, "eagle"), lookup_tokens=8)
    torch.manual_seed(0)
    out = lm.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.8, num_return_sequences=3,
                      return_dict_in_generate=True, output_logits=True, **inputs)
    assert out.sequences.shape == (3, ids.shape[1] + 24)
    assert len({tuple(row.tolist()) for row in out.sequences}) > 1  # three draws, not one
    for row, sequence in enumerate(out.sequences):
        extra = dict(inputs)
        if "mm_token_type_ids" in extra:  # the processor's per-token modality: text after the prompt
            extra["mm_token_type_ids"] = torch.cat(
                [extra["mm_token_type_ids"], torch.zeros(1, 24, dtype=torch.int)], dim=1)
        with torch.no_grad():
            full = target(input_ids=sequence[None], **extra).logits[0]  # (n + 24, V)
        steps = torch.stack([step[row] for step in out.logits])  # (24, V)
        torch.testing.assert_close(steps, full[ids.shape[1] - 1: -1], rtol=1e-4, atol=1e-4)


def test_generation_settings_given_as_keywords_update_the_config(tiny_vlm_factory):
    """As transformers: a GenerationConfig field passed to generate applies (or is refused by name)."""
    target, ids, inputs = tiny_vlm_factory("llava")
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    first = int(target_greedy(target, ids, inputs, 1)[0, -1])
    expected = target.generate(input_ids=ids, **inputs, max_new_tokens=12, do_sample=False,
                               begin_suppress_tokens=[first])
    assert int(expected[0, ids.shape[1]]) != first
    assert torch.equal(lm.generate(ids, max_new_tokens=12, begin_suppress_tokens=[first], **inputs), expected)
    assert target.generation_config.begin_suppress_tokens is None  # a copy was updated, not the target's
    with pytest.raises(ValueError, match="num_beams=2"):
        lm.generate(ids, max_new_tokens=4, num_beams=2)


def test_extra_inputs_are_checked_by_name(tiny_vlm_factory):
    target, ids, inputs = tiny_vlm_factory("qwen2_vl")
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    with pytest.raises(TypeError, match=r"unknown argument 'pixel_valuez'.*extra inputs: .*image_grid_thw"):
        lm.generate(ids, max_new_tokens=4, pixel_valuez=inputs["pixel_values"])
    with pytest.raises(ValueError, match="sets 'position_ids' itself"):
        lm.generate(ids, max_new_tokens=4, position_ids=torch.arange(ids.shape[1])[None])
    with pytest.raises(TypeError, match="'image_grid_thw' must be a torch.Tensor, got list"):
        lm.generate(ids, max_new_tokens=4, **dict(inputs, image_grid_thw=[[1, 8, 8]]))
    batch = torch.cat([ids, ids])
    with pytest.raises(ValueError, match="need one prompt per call, got batch size 2"):
        lm.generate(batch, max_new_tokens=4, **inputs)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with pytest.raises(ValueError, match="need an unpadded prompt"):
        lm.generate(padded, attention_mask=mask, max_new_tokens=4, **inputs)
    with pytest.raises(ValueError, match="batched=True cannot be combined"):
        lm.generate(ids, max_new_tokens=4, batched=True, **inputs)
    # text prompts on a vision-language target need no extra inputs, and take the batched paths as usual
    assert torch.equal(lm.generate(batch, max_new_tokens=8), target.generate(batch, max_new_tokens=8, do_sample=False))


def test_load_target_reads_a_vision_language_folder(story_vlm_dir, stories260k):
    target, tokenizer = load_target(story_vlm_dir)
    assert type(target).__name__ == "LlavaForConditionalGeneration" and not target.training
    assert len(tokenizer) == 513 and tokenizer.convert_tokens_to_ids("<image>") == 512
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    # the text side is stories260K: a text prompt continues as stories260K does
    torch.testing.assert_close(target.generate(ids, max_new_tokens=12, do_sample=False),
                               stories260k[0].generate(ids, max_new_tokens=12, do_sample=False), rtol=0, atol=0)


def write_image(path, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((20, 24, 3)) * 255).astype("uint8")).save(path)
    return str(path)


def test_image_prompt_uses_the_targets_processor(story_vlm_dir, tmp_path):
    image = write_image(tmp_path / "a.png")
    input_ids, inputs, processor = image_prompt(str(story_vlm_dir), "Once upon a time", [image])
    assert (input_ids == 512).sum() == 16 and set(inputs) == {"pixel_values"}
    assert inputs["pixel_values"].shape == (1, 3, 16, 16)
    assert processor.tokenizer.decode(input_ids[0], skip_special_tokens=True).strip() == "Once upon a time"
    with pytest.raises(FileNotFoundError, match="missing.png"):
        image_prompt(str(story_vlm_dir), "Hi", [str(tmp_path / "missing.png")])
    with pytest.raises(ValueError, match="ships no processor that takes images"):
        image_prompt("stories260K", "Hi", [image])


def test_image_prompts_get_one_bos_as_transformers_processors_give_it(story_vlm_dir, tmp_path):
    """A template that writes no BOS gets the tokenizer's; one that writes BOS itself (Gemma 3's) gets no second one,
    as transformers' `processor.apply_chat_template(..., tokenize=True)` does."""
    from transformers import AutoProcessor

    from specheads.inference.multimodal import encode_image_prompt, load_images

    processor = AutoProcessor.from_pretrained(story_vlm_dir)
    images = load_images([write_image(tmp_path / "a.png")])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Once upon a time"}]}]
    for template in (processor.chat_template, "<s>" + processor.chat_template):
        input_ids, _ = encode_image_prompt(processor, messages, images, chat_template=template)
        expected = processor.apply_chat_template(messages, add_generation_prompt=True, chat_template=template,
                                                 tokenize=True, return_dict=True, images=images)["input_ids"]
        assert input_ids[0].tolist() == list(expected[0]) and input_ids[0].tolist().count(1) == 1


def test_a_chat_session_shows_images_and_keeps_its_cache(story_vlm_dir, tmp_path, monkeypatch, capfd):
    """`ChatSession(processor=...)`: each turn is the target's own answer to the conversation with all its images
    (rendered by the processor), the cache reused across turns; `specheads chat --image` and `/image FILE` the same."""
    import io
    import sys

    from transformers import AutoProcessor

    from specheads.inference.chat import ChatSession
    from specheads.inference.multimodal import encode_image_prompt, load_images

    target, tokenizer = load_target(story_vlm_dir)
    processor = AutoProcessor.from_pretrained(story_vlm_dir)
    heads = heads_for(target, "eagle")
    a, b = write_image(tmp_path / "a.png"), write_image(tmp_path / "b.png", seed=5)

    def answer(messages, images, max_new_tokens=16):
        ids, inputs = encode_image_prompt(processor, messages, load_images(images))
        new = target_greedy(target, ids, inputs, max_new_tokens)[0, ids.shape[1]:]
        return tokenizer.decode(new, skip_special_tokens=True)

    def user(text, images=0):
        return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}

    def assistant(text):
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    session = ChatSession(SpeculativeLM(target, heads), processor=processor, max_new_tokens=16)
    first = session.ask("Once upon a time", images=[a])
    assert first == answer([user("Once upon a time", 1)], [a])
    second = session.ask("Then")
    history = [user("Once upon a time", 1), assistant(first), user("Then")]
    assert second == answer(history, [a]) and session.last_stats["reused_prompt_tokens"] > 16
    third = session.ask("Look", images=[b])  # a new image: the whole conversation runs again, with both images
    assert third == answer([*history, assistant(second), user("Look", 1)], [a, b])
    assert session.last_stats["reused_prompt_tokens"] == 0
    with pytest.raises(ValueError, match="has no processor, so its messages cannot show images"):
        ChatSession(SpeculativeLM(target, heads), tokenizer=tokenizer, chat_template="{{ 'x' }}").ask("Hi", images=[a])

    heads.save_pretrained(tmp_path / "heads")
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Once upon a time\nThen\n/image {b}\nLook\n"))
    assert main(["chat", "--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--image", a,
                 "--max-new-tokens", "16"]) == 0
    out, err = capfd.readouterr()
    assert first in out and second in out and third in out and f"{b} goes with the next message" in err


def test_cli_generate_answers_a_question_about_an_image(story_vlm_dir, tmp_path, capsys):
    target, tokenizer = load_target(story_vlm_dir)
    heads_for(target, "eagle").save_pretrained(tmp_path / "heads")
    image = write_image(tmp_path / "a.png")
    assert main(["generate", "--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--prompt",
                 "Once upon a time", "--image", image, "--max-new-tokens", "24", "--threads", "1"]) == 0
    printed = capsys.readouterr()
    input_ids, inputs, _ = image_prompt(str(story_vlm_dir), "Once upon a time", [image])
    expected = target_greedy(target, input_ids, inputs, 24)
    assert tokenizer.decode(expected[0], skip_special_tokens=True).strip() in printed.out
    assert "24 tokens, tau=" in printed.err
    assert main(["generate", "--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--prompts",
                 str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--image", image]) != 0
    assert "--image goes with --prompt" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_custom_generate_passes_the_images_through(tiny_vlm_factory, tmp_path, family):
    """`target.generate(..., pixel_values=..., custom_generate=heads)`: transformers hands the images on."""
    target, ids, inputs = tiny_vlm_factory(family)
    heads_for(target, "eagle").save_pretrained(tmp_path / "heads")
    folder = export_for_transformers(tmp_path / "heads", tmp_path / "exported")
    out = target.generate(input_ids=ids, **inputs, max_new_tokens=20, do_sample=False, custom_generate=str(folder),
                          trust_remote_code=True)
    assert torch.equal(out, target_greedy(target, ids, inputs, 20))


def test_heads_of_the_text_model_load_onto_the_vision_language_target(tiny_vlm_factory, tmp_path):
    """Heads record the text model's shape and family, so a checkpoint made on the VLM reloads onto it; the check
    against another target still refuses by name."""
    target, ids, inputs = tiny_vlm_factory("idefics3")
    heads_for(target, "eagle3").save_pretrained(tmp_path)
    heads = load_heads(tmp_path, target=target)
    assert heads.config.target_model_type == "llama" and heads.config.target_architectures == ["Idefics3ForConditionalGeneration"]
    other, _, _ = tiny_vlm_factory("qwen2_vl")
    with pytest.raises(ValueError, match="heads and target do not match"):
        load_heads(tmp_path, target=other)


def test_targets_that_cross_attend_to_images_are_refused_by_name():
    """Mllama reads its images through cross-attention layers (masked per step by transformers' generate): refused
    when the speculative model is built, not served inexactly."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(
        "mllama", image_token_index=150,
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=160, cross_attention_layers=[1], pad_token_id=0,
                         bos_token_id=1, eos_token_id=None),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_global_layers=1,
                           attention_heads=2, image_size=16, patch_size=4, vision_output_dim=32,
                           intermediate_layers_indices=[0], max_num_tiles=1, supported_aspect_ratios=[[1, 1]]))
    target = AutoModelForImageTextToText.from_config(config).eval()
    with pytest.raises(ValueError, match=r"MllamaForConditionalGeneration .*cross-attend to the image \(Mllama\)"):
        SpeculativeLM(target, create_heads(target, "medusa"))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "gemma3"])
def test_image_requests_join_a_running_batch_of_text_rows(tiny_vlm_factory, family):
    """Continuous batching (the server's engine): requests with images prefill alone, then verify in the batch's
    forwards beside text rows (on M-RoPE targets at their own shifted positions); every row equals target.generate."""
    target, ids, inputs = tiny_vlm_factory(family)
    lm = SpeculativeLM(target, heads_for(target, "eagle"), lookup_tokens=8)
    texts = [torch.tensor([[1, 7, 3, 8, 2, 11]]), torch.tensor([[1, 40]])]
    engine = BatchEngine(lm, prefill_chunk=4)  # chunked text prefill; an image prompt still runs in one forward
    image_rows = [lm.batch_request(ids, max_new_tokens=30, inputs=inputs) for _ in range(2)]
    text_rows = [lm.batch_request(t, max_new_tokens=24) for t in texts]
    joins = {0: text_rows[:1], 1: image_rows[:1], 3: [text_rows[1], image_rows[1]]}
    rounds = 0
    while engine.occupied or any(r >= rounds for r in joins):
        if rounds in joins:
            engine.add(joins.pop(rounds))
        engine.step()
        rounds += 1
    expected_image = target_greedy(target, ids, inputs, 30)[0, ids.shape[1]:].tolist()
    for request in image_rows:
        assert request.finished and request.new_tokens == expected_image
    for request, prompt in zip(text_rows, texts):
        assert request.new_tokens == target_greedy(target, prompt, {}, 24)[0, prompt.shape[1]:].tolist()
    assert engine.stats["batched_forwards"] < engine.stats["target_forwards"]  # rows shared forwards
    # a conversation's next turn about the same image, from its prompt cache: only the new text runs (in chunks)
    cache = PromptCache()
    first = lm.batch_request(ids, max_new_tokens=10, inputs=inputs, prompt_cache=cache)
    engine = BatchEngine(lm, prefill_chunk=2)
    engine.add([first])
    while not first.finished:
        engine.step()
    follow_up = torch.cat([ids, torch.tensor([first.new_tokens]), torch.tensor([[5, 9, 4, 6, 8]])], dim=1)
    follow_inputs = {name: (follow_up == VLM_IMAGE).long() if name.endswith("token_type_ids") else value
                     for name, value in inputs.items()}
    second = lm.batch_request(follow_up, max_new_tokens=10, inputs=follow_inputs, prompt_cache=cache)
    engine.add([second])
    while not second.finished:
        engine.step()
    assert second.reused_prompt_tokens == ids.shape[1] + 9
    assert second.new_tokens == target_greedy(target, follow_up, follow_inputs, 10)[0, follow_up.shape[1]:].tolist()


def test_text_after_an_image_prompt_keeps_plain_positions(tiny_vlm_factory):
    """An M-RoPE target keeps its last image prompt's delta (`rope_deltas`); a text prompt continued from a prompt
    cache afterwards is still placed at plain positions (transformers' generate resets the delta for it too)."""
    target, ids, inputs = tiny_vlm_factory("qwen2_vl")
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    lm.generate(ids, max_new_tokens=4, **inputs)
    assert int(target.model.rope_deltas) == -12
    cache = PromptCache()
    first = torch.tensor([[1, 7, 3, 8, 2, 11]])
    out = lm.generate(first, max_new_tokens=10, prompt_cache=cache)
    follow_up = torch.cat([out, torch.tensor([[5, 9, 4]])], dim=1)
    assert torch.equal(lm.generate(follow_up, max_new_tokens=10, prompt_cache=cache),
                       target_greedy(target, follow_up, {}, 10))
    assert lm.last_stats["reused_prompt_tokens"] > 0


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl", "idefics3"])
@pytest.mark.parametrize("head_type", ["eagle", "medusa"])
def test_image_prompts_on_the_static_cache_fast_path(tiny_vlm_factory, family, head_type):
    """fast_path=True (the GPU path, run eagerly here): the image prompt prefills as on the dynamic path, its entries
    move into the static cache, and the rounds verify at the text positions after the image (M-RoPE: checked to
    matter); the target's own greedy output, also for a chat's next turn from a prompt cache (Gemma 3's sliding
    window keeps it off the fast path)."""
    target, ids, inputs = tiny_vlm_factory(family)
    lm = SpeculativeLM(target, heads_for(target, head_type), tree_depth=4, tree_top_k=3, tree_num_nodes=12)
    expected = target_greedy(target, ids, inputs, 24)
    assert torch.equal(lm.generate(ids, max_new_tokens=24, fast_path=True, **inputs), expected)
    assert lm.last_stats["fast_path"] and lm._fast_runner.position_offset == (-12 if "qwen" in family else 0)
    cache = PromptCache()
    out = lm.generate(ids, max_new_tokens=10, fast_path=True, prompt_cache=cache, **inputs)
    follow_up = torch.cat([out, torch.tensor([[5, 9, 4]])], dim=1)
    follow_inputs = {name: (follow_up == VLM_IMAGE).long() if name.endswith("token_type_ids") else value
                     for name, value in inputs.items()}
    assert torch.equal(lm.generate(follow_up, max_new_tokens=10, fast_path=True, prompt_cache=cache, **follow_inputs),
                       target_greedy(target, follow_up, follow_inputs, 10))
    assert lm.last_stats["reused_prompt_tokens"] == out.shape[1] - 1
    # a text prompt after it starts from plain positions again
    text = torch.tensor([[1, 7, 3, 8, 2, 11]])
    assert torch.equal(lm.generate(text, max_new_tokens=10, fast_path=True), target_greedy(target, text, {}, 10))
    # whole-round graphs (EAGLE, greedy): used after an image at plain positions, stepped aside from after an M-RoPE one
    graphed = SpeculativeLM(target, lm.heads, tree_depth=4, tree_top_k=3, tree_num_nodes=12, graphed_rounds=True)
    assert torch.equal(graphed.generate(ids, max_new_tokens=24, fast_path=True, **inputs), expected)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_chat_about_an_image_reuses_its_cache(tiny_vlm_factory, family):
    """A `PromptCache` across the turns of a conversation about an image (each turn gives the images again, as
    transformers' generate takes them): the next turn runs only its new text, at the text positions the target
    itself uses (M-RoPE: after the grid's delta), with the target's own greedy output; other images, or new tokens
    that hold an image, run the whole prompt."""
    target, ids, inputs = tiny_vlm_factory(family)

    def inputs_of(prompt, images=inputs):  # per-token inputs (Gemma 3, Qwen) cover the whole prompt, as a processor's
        return {name: (prompt == VLM_IMAGE).long() if name.endswith("token_type_ids") else value
                for name, value in images.items()}

    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    cache = PromptCache()
    out = lm.generate(ids, max_new_tokens=10, prompt_cache=cache, **inputs)
    assert torch.equal(out, target_greedy(target, ids, inputs, 10))
    follow_up = torch.cat([out, torch.tensor([[5, 9, 4]])], dim=1)
    expected = target_greedy(target, follow_up, inputs_of(follow_up), 10)
    assert torch.equal(lm.generate(follow_up, max_new_tokens=10, prompt_cache=cache, **inputs_of(follow_up)), expected)
    assert lm.last_stats["reused_prompt_tokens"] == out.shape[1] - 1  # all but the answer's last token
    third = torch.cat([expected, torch.tensor([[6, 8]])], dim=1)
    assert torch.equal(lm.generate(third, max_new_tokens=8, prompt_cache=cache, **inputs_of(third)),
                       target_greedy(target, third, inputs_of(third), 8))
    assert lm.last_stats["reused_prompt_tokens"] == expected.shape[1] - 1
    # another picture behind the same tokens: nothing reused, the new image's answer
    other = inputs_of(third, {**inputs, "pixel_values": inputs["pixel_values"] + 1})
    assert torch.equal(lm.generate(third, max_new_tokens=8, prompt_cache=cache, **other),
                       target_greedy(target, third, other, 8))
    assert lm.last_stats["reused_prompt_tokens"] == 0
    # an edit before the image: the tokens after the shared prefix hold the image, so it all runs again
    edited = third.clone()
    edited[0, 0] = 7
    assert torch.equal(lm.generate(edited, max_new_tokens=8, prompt_cache=cache, **other),
                       target_greedy(target, edited, other, 8))
    assert lm.last_stats["reused_prompt_tokens"] == 0
    # the same conversation as text after it (no images given): the image entries are not used for it
    text = torch.tensor([[3, 14, 15, 92, 65, 5, 9]])
    assert torch.equal(lm.generate(text, max_new_tokens=8, prompt_cache=cache), target_greedy(target, text, {}, 8))
    assert lm.last_stats["reused_prompt_tokens"] == 0


def data_url(path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()


def test_the_server_answers_chat_requests_with_images(story_vlm_dir, tmp_path):
    """OpenAI chat requests with `image_url` parts (base64 data URLs) on a vision-language target: the answer is the
    target's own greedy one for the processor's prompt; text requests still reuse the conversation cache."""
    from specheads.inference.multimodal import encode_image_prompt, image_processor_for
    from specheads.inference.openai_api import ApiError
    from specheads.inference.server import CompletionService

    target, tokenizer = load_target(story_vlm_dir)
    processor = image_processor_for(str(story_vlm_dir))
    assert image_processor_for("stories260K") is None  # a text target's folder: no image processor
    lm = SpeculativeLM(target, heads_for(target, "eagle"), tokenizer=tokenizer)
    service = CompletionService(lm, "vlm", {"max_new_tokens": 16}, cache_slots=2, processor=processor)
    try:
        image = write_image(tmp_path / "a.png", seed=3)
        body = {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "Once upon a"}]}]}
        parsed = service.parse(body, chat=True)
        assert set(parsed.inputs) == {"pixel_values"}
        choices, usage, _ = service.complete(parsed)
        content = [{"type": "image"}, {"type": "text", "text": "Once upon a"}]
        ids, inputs = encode_image_prompt(processor, [{"role": "user", "content": content}],
                                          [Image.open(image).convert("RGB")])
        expected = target_greedy(target, ids, inputs, 16)[0, ids.shape[1]:]
        assert choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert usage["prompt_tokens"] == ids.shape[1]
        # the next turn re-sends the conversation with its image: only the new text runs, the answer still the target's
        # (the answer's space back in front: this template joins turns with nothing between them)
        turns = [*body["messages"], {"role": "assistant", "content": " " + choices[0].text},
                 {"role": "user", "content": [{"type": "text", "text": "Then"}]}]
        choices, usage, _ = service.complete(service.parse({"messages": turns}, chat=True))
        ids, inputs = encode_image_prompt(processor, [
            {"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": turns[1]["content"]}]},
            {"role": "user", "content": [{"type": "text", "text": "Then"}]}], [Image.open(image).convert("RGB")])
        expected = target_greedy(target, ids, inputs, 16)[0, ids.shape[1]:]
        assert choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 16  # the image's tokens among them
        for part, needle in (({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                              "expected a data: URL"),
                             ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
                              "holds no readable image"),
                             ({"type": "input_audio"}, "only 'text' parts are supported .and 'image_url' ones")):
            with pytest.raises(ApiError, match=needle):
                service.parse({"messages": [{"role": "user", "content": [part]}]}, chat=True)
        with pytest.raises(ApiError, match=r"content\[1\] has type 'input_audio': expected 'text' or 'image_url'"):
            service.parse({"messages": [{"role": "user", "content": [body["messages"][0]["content"][0],
                                                                    {"type": "input_audio"}]}]}, chat=True)
        # tools: this processor's template shows none, so they are refused; one that shows them gets them
        weather = {"type": "function", "function": {"name": "weather"}}
        with pytest.raises(ApiError, match="does not show tools"):
            service.parse({**body, "tools": [weather], "tool_choice": "required"}, chat=True)
    finally:
        service.close()
    tool_template = "{% if tools %}<tool_call>{{ tools[0]['function']['name'] }}: {% endif %}" + processor.chat_template
    with_tools = CompletionService(lm, "vlm", {"max_new_tokens": 4}, cache_slots=0, processor=processor,
                                   chat_template=tool_template)
    try:
        assert with_tools.tool_parser.name == "hermes"
        parsed = with_tools.parse({**body, "tools": [weather]}, chat=True)
        text = tokenizer.decode(parsed.input_ids[0])
        assert "weather: " in text and set(parsed.inputs) == {"pixel_values"} and parsed.tools.choice == "auto"
    finally:
        with_tools.close()
    text_only = CompletionService(lm, "vlm", {"max_new_tokens": 4}, cache_slots=0)
    try:
        with pytest.raises(ApiError, match="this model takes no images"):
            text_only.parse(body, chat=True)
    finally:
        text_only.close()


def test_bench_measures_prompts_about_images(story_vlm_dir, tmp_path, monkeypatch):
    """`specheads bench` with JSONL records holding `image` paths (relative to the file): every run of a prompt gets
    its image (greedy outputs checked identical to target.generate's with it); text records in the same file too."""
    import json

    from specheads.inference.bench import bench_main
    from specheads.inference.prompts import read_prompts

    target, _ = load_target(story_vlm_dir)
    heads_for(target, "eagle").save_pretrained(tmp_path / "heads")
    write_image(tmp_path / "cat.png", seed=1)
    records = [{"prompt_id": "a", "category": "vision", "text": "Once upon a time", "image": "cat.png"},
               {"prompt_id": "b", "category": "text", "text": "The dog ran"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert read_prompts(prompts)[0]["images"] == [str(tmp_path / "cat.png")]
    out = tmp_path / "bench" / "results.json"
    seen = []
    original = SpeculativeLM.generate
    monkeypatch.setattr(SpeculativeLM, "generate",
                        lambda self, *a, **k: seen.append(sorted(k.get("pixel_values", torch.empty(0)).shape))
                        or original(self, *a, **k))
    assert bench_main(["--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--prompts", str(prompts),
                       "--max-new-tokens", "12", "--threads", "1", "--out", str(out), "--prompt-lookup", "2"]) == 0
    results = json.loads(out.read_text())
    assert results["greedy_identical"] is True
    assert set(results["greedy"]["by_category"]) == {"vision", "text"}
    assert [1, 3, 16, 16] in seen and [0] in seen  # the image prompt ran with its image, the text one without
    monkeypatch.undo()
    heads_for(load_target("stories260K")[0], "eagle").save_pretrained(tmp_path / "text_heads")
    with pytest.raises(ValueError, match="prompt a has images, but the target takes none"):
        bench_main(["--target", "stories260K", "--heads", str(tmp_path / "text_heads"), "--prompts", str(prompts),
                    "--out", str(tmp_path / "x.json")])


def test_generate_prompts_file_answers_records_about_images(story_vlm_dir, tmp_path, capfd):
    """`generate --prompts FILE`: a record's image reaches its prompt (in the continuous batch beside text rows)."""
    import json

    target, tokenizer = load_target(story_vlm_dir)
    heads_for(target, "eagle").save_pretrained(tmp_path / "heads")
    image = write_image(tmp_path / "cat.png", seed=2)
    records = [{"id": "a", "prompt": "Once upon a time", "images": ["cat.png"]}, {"id": "b", "prompt": "The dog ran"}]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert main(["generate", "--target", str(story_vlm_dir), "--heads", str(tmp_path / "heads"), "--prompts",
                 str(prompts), "--out", str(out), "--max-new-tokens", "16", "--threads", "1"]) == 0
    answers = {json.loads(line)["id"]: json.loads(line)["answer"] for line in out.read_text().splitlines()}
    ids, inputs, _ = image_prompt(str(story_vlm_dir), "Once upon a time", [image])
    expected = target_greedy(target, ids, inputs, 16)[0, ids.shape[1]:]
    assert answers["a"] == tokenizer.decode(expected, skip_special_tokens=True)
    from specheads.inference.prompts import tokenize_prompts

    row = {"prompt_id": "b", "category": "default", "text": "The dog ran"}
    text_ids = tokenize_prompts([row], tokenizer)[0].input_ids  # the chat template, as the command applies it
    assert answers["b"] == tokenizer.decode(target_greedy(target, text_ids, {}, 16)[0, text_ids.shape[1]:],
                                            skip_special_tokens=True)


def test_prompt_records_take_images_from_a_dataset_image_column(story_vlm_dir, tmp_path):
    """A saved dataset whose `image` column holds images (datasets' Image feature gives PIL images): the prompts made
    from it equal those made from the same image as a file."""
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    from specheads.inference.multimodal import image_processor_for
    from specheads.inference.prompts import read_prompts, tokenize_prompts

    path = write_image(tmp_path / "a.png", seed=4)
    features = Features({"prompt_id": Value("string"), "text": Value("string"), "image": ImageFeature()})
    Dataset.from_dict({"prompt_id": ["a"], "text": ["Once upon a time"], "image": [path]},
                      features=features).save_to_disk(tmp_path / "vqa")
    rows = read_prompts(tmp_path / "vqa")
    assert not isinstance(rows[0]["images"][0], str)  # a PIL image, not a path
    _, tokenizer = load_target(story_vlm_dir)
    (prompt,) = tokenize_prompts(rows, tokenizer, processor=image_processor_for(str(story_vlm_dir)))
    ids, inputs, _ = image_prompt(str(story_vlm_dir), "Once upon a time", [path])
    assert torch.equal(prompt.input_ids, ids)
    torch.testing.assert_close(prompt.inputs["pixel_values"], inputs["pixel_values"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="prompt a has images, but the target takes none"):
        tokenize_prompts(rows, tokenizer)


def test_a_video_prompt_on_qwen2_vl_gives_the_targets_output(tiny_vlm_factory, oracle_drafter):
    """Video inputs (`pixel_values_videos`, `video_grid_thw`): 2 x 8 x 8 patches, 32 video tokens; the text after them
    sits at its own M-RoPE positions, and mostly-right drafts are accepted exactly."""
    from ..conftest import VLM_END, VLM_START

    target, _, _ = tiny_vlm_factory("qwen2_vl")
    video = 151
    ids = [3, 14, VLM_START, *[video] * 32, VLM_END, 15, 92, 65]
    inputs = dict(pixel_values_videos=torch.randn(128, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(5)),
                  video_grid_thw=torch.tensor([[2, 8, 8]]),
                  mm_token_type_ids=torch.tensor([[2 if i == video else 0 for i in ids]]))
    ids = torch.tensor([ids])
    expected = target_greedy(target, ids, inputs, 40)
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    lm.drafter = oracle_drafter(expected[0].tolist() + [1] * 8, 160, depth=5, corruption_rate=0.15, seed=4)
    assert torch.equal(lm.generate(ids, max_new_tokens=40, **inputs), expected)
    lm.drafter.check_accepted()
    assert position_offset(target, inputs) == int(target.model.rope_deltas) != 0


def test_a_vision_language_target_by_hub_id_from_the_offline_cache(story_vlm_dir, offline_hub_cache, tmp_path):
    """`load_target("org/vlm")` and its processor resolve through the HF cache with the Hub offline; `generate --image`
    then runs on the Hub id."""
    offline_hub_cache.publish(story_vlm_dir, "test-org/story-vlm")
    target, tokenizer = load_target("test-org/story-vlm")
    assert type(target).__name__ == "LlavaForConditionalGeneration"
    image = write_image(tmp_path / "a.png")
    ids, inputs, _ = image_prompt("test-org/story-vlm", "Once upon a time", [image])
    local_ids, local_inputs, _ = image_prompt(str(story_vlm_dir), "Once upon a time", [image])
    assert torch.equal(ids, local_ids) and torch.equal(inputs["pixel_values"], local_inputs["pixel_values"])
    lm = SpeculativeLM(target, heads_for(target, "eagle"))
    assert torch.equal(lm.generate(ids, max_new_tokens=12, **inputs), target_greedy(target, ids, inputs, 12))
