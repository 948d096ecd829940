"""Chat-template keywords (`enable_thinking` of Qwen3-style reasoning switches) given alike to the training data, the
target's own answers (`data regenerate`) and every way a prompt is made at inference (generate, bench, chat, serve),
and conversations whose template drops earlier turns' reasoning trained one assistant turn at a time, with the
context the target sees when it answers that turn (SpecForge #296: heads trained on one rendering, used on another)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from specheads.training.conversations import NotIncrementalTemplate, tokenize_record
from specheads.training.data import build_dataset

# a Qwen3-style template (written for these tests): the generation prompt closes an empty <think> block when
# enable_thinking is false, and an assistant turn before the last user message loses its reasoning
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}"
    "{%- if '</think>' in content and loop.index0 < ns.last_user -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if m.get('reasoning_content') and loop.index0 > ns.last_user -%}"
    "{%- set content = '<think>' + m['reasoning_content'] + '</think>' + content -%}{%- endif -%}"
    "<|assistant|>{{ content }}<|end|>"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think></think>{%- endif -%}{%- endif -%}"
)
NO_THINKING = {"enable_thinking": False}


@pytest.fixture()
def thinking_tokenizer(target_and_tokenizer):
    tokenizer = copy.deepcopy(target_and_tokenizer[1])
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, **kwargs)["input_ids"]


def test_template_keywords_reach_the_prompt_part_of_each_example(thinking_tokenizer, tmp_path):
    record = {"messages": [{"role": "user", "content": "Tell a story."},
                           {"role": "assistant", "content": "Once upon a time there was a cat."}]}
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(record) + "\n")
    for kwargs in ({}, NO_THINKING):
        row = build_dataset(data, thinking_tokenizer, max_length=128, chat_template_kwargs=kwargs)[0]
        start = row["loss_mask"].index(1)
        # the context is what the target is prompted with under the same keywords, at inference
        assert row["input_ids"][:start] == prompt_ids(thinking_tokenizer, record["messages"][:1], **kwargs)
        assert ("<think></think>" in thinking_tokenizer.decode(row["input_ids"][:start])) == bool(kwargs)


def test_a_template_that_drops_earlier_reasoning_trains_each_turn_in_its_own_context(thinking_tokenizer, tmp_path,
                                                                                     caplog):
    messages = [{"role": "user", "content": "Tell a story."},
                {"role": "assistant", "content": "<think>a cat</think>There was a cat."},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "<think>a dog</think>A dog came."}]
    with pytest.raises(NotIncrementalTemplate, match="assistant turn 3"):
        tokenize_record(thinking_tokenizer, {"messages": messages}, "openai", 256)
    data = tmp_path / "reasoning.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": messages[:2]}) + "\n")
    with caplog.at_level(logging.INFO, logger="specheads.training.data"):
        dataset = build_dataset(data, thinking_tokenizer, max_length=256)
    assert "1 multi-turn conversations were cut into one example per assistant turn" in caplog.text
    assert len(dataset) == 3  # two turns of the first conversation, the second as it is
    for row, turn in ((dataset[0], 1), (dataset[1], 3), (dataset[2], 1)):
        start = row["loss_mask"].index(1)
        assert row["input_ids"][:start] == prompt_ids(thinking_tokenizer, messages[:turn])  # the inference context
        trained = thinking_tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert trained.startswith(messages[turn]["content"]) and all(row["loss_mask"][start:])
    # the second turn's context holds the first answer without its reasoning, as the template renders it
    assert "<think>a cat" not in thinking_tokenizer.decode(dataset[1]["input_ids"])


def test_config_and_command_lines_take_template_keywords(tmp_path, capsys):
    from specheads.cli import main
    from specheads.inference.prompts import json_object
    from specheads.training.config import load_run_config

    config = load_run_config(None, ["data.source=x.jsonl", "data.chat_template_kwargs.enable_thinking=false"])
    assert config.data.chat_template_kwargs == NO_THINKING
    assert json_object('{"enable_thinking": false}') == NO_THINKING
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--heads", "h", "--prompt", "Hi", "--chat-template-kwargs", "[1]"])
    assert exit_info.value.code == 2 and "expected a JSON object" in capsys.readouterr().err


def test_inference_prompts_take_the_same_keywords(thinking_tokenizer, target_and_tokenizer):
    from specheads import SpeculativeLM, create_heads
    from specheads.inference.chat import ChatSession
    from specheads.inference.openai_api import ApiError, parse_request
    from specheads.inference.prompts import follow_up, tokenize_prompts

    row = {"prompt_id": "a", "category": "x", "text": "Tell a story.", "turns": ["Tell a story.", "Go on."]}
    (plain,) = tokenize_prompts([row], thinking_tokenizer)
    (asked,) = tokenize_prompts([row], thinking_tokenizer, template_kwargs=NO_THINKING)
    user = [{"role": "user", "content": "Tell a story."}]
    assert asked.input_ids[0].tolist() == prompt_ids(thinking_tokenizer, user, **NO_THINKING) != plain.input_ids[0].tolist()
    second = follow_up(asked, ["Once."], thinking_tokenizer, NO_THINKING)
    assert thinking_tokenizer.decode(second.input_ids[0]).endswith("<think></think>")
    # the server: its default keywords, updated by a request's chat_template_kwargs (vLLM's field)
    body = {"messages": user}
    for default, request, thinking in ((None, None, True), (NO_THINKING, None, False),
                                       (NO_THINKING, {"enable_thinking": True}, True)):
        parsed = parse_request({**body, **({"chat_template_kwargs": request} if request else {})}, True,
                               thinking_tokenizer, {}, template_kwargs=default)
        assert thinking_tokenizer.decode(parsed.input_ids[0]).endswith("<think></think>") != thinking
    with pytest.raises(ApiError, match="chat_template_kwargs=.*expected an object"):
        parse_request({**body, "chat_template_kwargs": "no"}, True, thinking_tokenizer, {})
    # a chat session renders every turn with them
    target = target_and_tokenizer[0]
    lm = SpeculativeLM(target, create_heads(target, "eagle").eval(), tokenizer=thinking_tokenizer)
    session = ChatSession(lm, chat_template_kwargs=NO_THINKING, max_new_tokens=4)
    session.messages.append(user[0])
    assert thinking_tokenizer.decode(session.render()[0]).endswith("<think></think>")


def test_regenerate_prompts_the_target_with_the_keywords(thinking_tokenizer, target_and_tokenizer, tmp_path):
    from specheads.training.data_cli import regenerate

    target = target_and_tokenizer[0]
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Tell a story."}]}) + "\n")
    out = tmp_path / "answers.jsonl"
    regenerate(target, thinking_tokenizer, out, input_path=data, max_new_tokens=8, temperature=0.0,
               show_progress=False, chat_template_kwargs=NO_THINKING)
    answer = json.loads(out.read_text())["messages"][-1]["content"]
    ids = torch.tensor([prompt_ids(thinking_tokenizer, [{"role": "user", "content": "Tell a story."}], **NO_THINKING)])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert answer == thinking_tokenizer.decode(expected, skip_special_tokens=True)


def test_reasoning_content_is_trained_where_the_template_renders_it(thinking_tokenizer, target_and_tokenizer, tmp_path,
                                                                    caplog):
    record = {"messages": [{"role": "user", "content": "Tell a story."},
                           {"role": "assistant", "content": "There was a cat.", "reasoning_content": "a cat story"}]}
    data = tmp_path / "thoughts.jsonl"
    data.write_text(json.dumps(record) + "\n")
    row = build_dataset(data, thinking_tokenizer, max_length=128)[0]
    trained = thinking_tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert trained.startswith("<think>a cat story</think>There was a cat.")
    plain = copy.deepcopy(target_and_tokenizer[1])  # a template that never reads reasoning_content: said so
    plain.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}" \
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    with caplog.at_level(logging.WARNING):
        row = build_dataset(data, plain, max_length=128)[0]
    assert "1 records hold reasoning_content, which the chat template never renders: it is not trained" in caplog.text
    assert "a cat story" not in plain.decode(row["input_ids"])


TOOL_TEMPLATE = (  # a tool-calling template written for these tests: tools in the prompt, calls and results rendered
    "{%- if tools -%}<|tools|>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}<|end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "<|assistant|>{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}({{ c['function']['arguments'] }})"
    "</call>{% endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' -%}<|tool|>{{ m['content'] }}<|end|>"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def test_tool_calling_conversations_train_the_calls_as_the_template_renders_them(target_and_tokenizer, tmp_path):
    tokenizer = copy.deepcopy(target_and_tokenizer[1])
    tokenizer.chat_template = TOOL_TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    record = {"tools": tools, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": "rain"},
        {"role": "assistant", "content": "It rains."}]}
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps(record) + "\n")
    row = build_dataset(data, tokenizer, max_length=256)[0]
    text = tokenizer.decode(row["input_ids"])
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert text.startswith("<|tools|>weather<|end|>")  # the record's tools reach the template
    assert '<call>weather({"city": "Oslo"})</call>' in trained and "It rains." in trained and "rain<" not in trained
    # ShareGPT's function_call / observation turns (LLaMA-Factory's layout) are the assistant's and the tool's
    sharegpt = {"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "weather()"},
                                  {"from": "observation", "value": "rain"}, {"from": "gpt", "value": "It rains."}]}
    row = tokenize_record(tokenizer, sharegpt, "sharegpt", 256)
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "weather()" in trained and "It rains." in trained and "rain<" not in trained


def test_regenerate_gives_the_target_the_records_tools(target_and_tokenizer, tmp_path):
    from specheads.training.data_cli import regenerate

    target = target_and_tokenizer[0]
    tokenizer = copy.deepcopy(target_and_tokenizer[1])
    tokenizer.chat_template = TOOL_TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "a", "tools": tools, "messages": [{"role": "user", "content": "Weather?"}]}) + "\n")
    out = tmp_path / "answers.jsonl"
    regenerate(target, tokenizer, out, input_path=data, max_new_tokens=8, temperature=0.0, show_progress=False)
    written = json.loads(out.read_text())
    ids = torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": "Weather?"}], tools=tools)])
    assert tokenizer.decode(ids[0]).startswith("<|tools|>weather")
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert written["tools"] == tools and written["messages"][-1]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
