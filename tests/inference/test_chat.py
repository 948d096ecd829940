"""`ChatSession`: each turn's answer is what `target.generate` writes for the rendered conversation, with the
target's cache reused between turns, and a failed turn leaves the history as it was."""

from __future__ import annotations

import pytest

from specheads import SpeculativeLM
from specheads.inference.chat import ChatSession, read_chat_template

from .conftest import make_heads

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
QUESTIONS = ["Tom had a big red ball", "Where did the ball go", "Who found it"]


def expected_answer(target, tokenizer, messages, max_new_tokens: int) -> str:
    """The reference: plain greedy `generate` on the whole rendered conversation."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=TEMPLATE,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("head_type", ["medusa", "eagle3"])
@pytest.mark.parametrize("reuse_cache", [True, False])
def test_every_turn_is_the_targets_answer_to_the_conversation(stories260k, head_type, reuse_cache):
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, head_type), tokenizer=tokenizer)
    chat = ChatSession(lm, system="Tell stories.", chat_template=TEMPLATE, reuse_cache=reuse_cache, max_new_tokens=24)
    for turn, question in enumerate(QUESTIONS):
        answer = chat.ask(question)
        asked = chat.messages[:-1]
        assert asked[-1] == {"role": "user", "content": question}
        assert answer == expected_answer(target, tokenizer, asked, 24)
        assert chat.messages[-1] == {"role": "assistant", "content": answer}
        reused = chat.last_stats["reused_prompt_tokens"]
        # the previous turns' rendering is reused (the re-rendered answer text may tokenize differently at its end)
        assert (reused > chat.last_stats["prompt_tokens"] // 2) if (turn and reuse_cache) else reused == 0
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "Tell stories."}]
    assert chat.ask(QUESTIONS[0]) == expected_answer(target, tokenizer, chat.messages[:-1], 24)
    assert chat.last_stats["reused_prompt_tokens"] == 0


def test_a_failed_turn_leaves_the_history_and_the_next_turn_is_exact(stories260k):
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    chat = ChatSession(lm, chat_template=TEMPLATE, max_new_tokens=16)
    chat.ask(QUESTIONS[0])
    history = list(chat.messages)

    def interrupt(input_ids, scores):
        raise KeyboardInterrupt

    chat.generate_options["logits_processor"] = [interrupt]  # Ctrl-C in the middle of the answer
    with pytest.raises(KeyboardInterrupt):
        chat.ask(QUESTIONS[1])
    assert chat.messages == history
    del chat.generate_options["logits_processor"]
    answer = chat.ask(QUESTIONS[1])
    assert answer == expected_answer(target, tokenizer, chat.messages[:-1], 16)


def test_bad_input_is_refused_by_name(stories260k, tmp_path):
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle"), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        ChatSession(lm)  # stories260K's tokenizer has none
    chat = ChatSession(lm, chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="empty"):
        chat.ask("  ")
    assert chat.messages == []
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert read_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE == read_chat_template(TEMPLATE)
