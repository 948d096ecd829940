"""OpenAI API requests to `generate` calls, and the answers back: the wire format of `specheads serve`.

`parse_request` checks a `/v1/chat/completions` or `/v1/completions` body and turns it into the prompt's token ids
and `generate` keyword arguments; every refusal is an `ApiError` naming the field, its value and what was expected.
The fields that would change the answer in a way this engine cannot (best_of > n, echo, suffix, the deprecated
`functions`) are refused rather than ignored; fields that do not change it (user, metadata) are ignored. Presence and
frequency penalties and logit biases are logits processors (inference/openai_penalties.py), exact on token trees.
Extensions, as vLLM takes them: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, and the
constraints guided_json / guided_regex / guided_choice / structured_outputs. Log-probabilities are the
target's own, from its raw logits (vLLM's default), for the answer's tokens (not a stop string's, nor a final EOS).
A vision-language target's chat messages may hold `image_url` parts (base64 data URLs): its processor makes the prompt.
Chat requests may carry `tools` (inference/tool_calls.py): the chat template shows them, the answer's calls come back
as `tool_calls`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .generate_inputs import eos_ids
from .openai_errors import ApiError
from .predicted_outputs import prediction_tokens
from .structured_outputs import structured_output
from .tool_call_stream import CallDelta
from .tool_calls import ToolCall, ToolRequest, ToolRequestError, template_message, tool_request

REFUSED = {  # field -> (the values that leave the answer as it is, why any other is refused)
    "functions": ((None, []), "use tools (the deprecated functions field is not supported)"),
    "function_call": ((None, "none"), "use tool_choice (the deprecated function_call field is not supported)"),
    "echo": ((None, False), "echoing the prompt is not supported"),
    "suffix": ((None, ""), "suffixes are not supported"),
}
MAX_CHOICES = 16  # n at most: the choices of one request are rows of the running batch
ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer name for system instructions


@dataclass
class ParsedRequest:
    """A checked request: the prompt (1, n), `generate` options, the stop strings, and how to answer."""

    input_ids: torch.Tensor
    options: dict[str, Any]
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    json_schema: dict[str, Any] | None = None  # the answer must be JSON valid under this schema
    json_object: bool = False  # the answer must be one JSON object (response_format json_object)
    regex: str | None = None  # the answer must match this regex (vLLM's guided_regex / guided_choice)
    constraint_field: str = "response_format"  # the request field that asked for the constraint (named in errors)
    logprobs: int | None = None  # None: none returned; k: each token's log-probability and its k likeliest rivals
    n: int = 1  # choices to return (sampled independently; greedy ones are all the same answer)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the prompt's images (a vision-language target)
    tools: ToolRequest | None = None  # a chat request's tools: the answer's calls are read out of its text
    presence_penalty: float = 0.0  # OpenAI's penalties on tokens the answer already holds (`OccurrencePenalties`)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (`LogitBias`)
    prediction: list[int] = field(default_factory=list)  # OpenAI's Predicted Outputs (inference/predicted_outputs.py)
    messages: list[dict[str, Any]] | None = None  # a chat request's messages as sent (`serve --record` keeps them)


@dataclass
class Choice:
    """One generated choice of an answer."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls read out of the answer (`text` is the rest)
    unsent: str = ""  # streamed: the content held back while it could have been a call, sent at the end
    reasoning: str | None = None  # the answer's think block (None: it has none)
    unsent_reasoning: str = ""  # streamed: the reasoning held back while it could have been the block's end
    unsent_calls: list[CallDelta] = field(default_factory=list)  # streamed: the pieces that finish the calls
    reasoning_tokens: int = 0  # of the answer's tokens, those of its reasoning block (tags included)


def _number(body: dict[str, Any], name: str, kind: type, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = ("" if low is None else f" {'>' if low_open else '>='} {low}") + ("" if high is None else f" and <= {high}")
        raise ApiError(f"{name}={value!r}: expected {'an integer' if kind is int else 'a number'}{bounds}", param=name)
    return kind(value)


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError(f"stop={stop!r}: expected a non-empty string or a list of at most 16 of them", param="stop")
    return stops


def _message_text(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else message
        raise ApiError(f"messages[{index}]: role {role!r}, expected one of {', '.join(ROLES)}", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only (image parts go to `_image_chat_prompt`)
        kinds = [part.get("type") if isinstance(part, dict) else type(part).__name__ for part in content]
        if any(kind != "text" for kind in kinds):
            raise ApiError(f"messages[{index}].content has parts of type {kinds}: only 'text' parts are supported "
                           "(and 'image_url' ones by a vision-language target)", param="messages")
        content = "".join(str(part.get("text", "")) for part in content)
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        content = ""  # an assistant turn that only calls tools
    if not isinstance(content, str):
        raise ApiError(f"messages[{index}].content={content!r}: expected a string", param="messages")
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise ApiError(f"messages[{index}].tool_calls={calls!r}: expected an assistant's list of {{'id', 'type': "
                       "'function', 'function': {'name', 'arguments'}}", param="messages")
    reasoning = message.get("reasoning_content")  # an earlier answer's reasoning: templates that keep it read it
    return {"role": "system" if message["role"] == "developer" else message["role"], "content": content,
            **template_message(message), **({"reasoning_content": reasoning} if isinstance(reasoning, str) else {})}


def _has_images(messages: list[Any]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") == "image_url" for part in m["content"])
               for m in messages)


def _data_url_image(part: dict[str, Any], where: str) -> Any:
    """The RGB PIL image of an `image_url` content part holding a base64 `data:` URL (nothing is fetched)."""
    from PIL import Image, UnidentifiedImageError

    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url if not isinstance(url, str) or len(url) < 80 else url[:80] + "..."
        raise ApiError(f"{where}.image_url.url={shown!r}: expected a data: URL (data:image/png;base64,...); this "
                       "server fetches nothing", param="messages")
    header, _, payload = url.partition(",")
    try:
        if not header.endswith(";base64"):
            raise ValueError("not base64-encoded")
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (ValueError, binascii.Error, UnidentifiedImageError, OSError) as err:
        raise ApiError(f"{where}.image_url holds no readable image: {err}", param="messages") from err
    return image.convert("RGB")


def _image_chat_prompt(
    messages: list[Any], processor: Any, chat_template: str | None, template_kwargs: dict[str, Any],
    read: list[str] | None = None,
) -> tuple[torch.Tensor, dict]:
    """(ids (1, n), extra model inputs) of chat messages with `image_url` parts, through the target's processor;
    `read`: the request's fields the template must read (`_check_template_reads`)."""
    from specheads.inference.multimodal import encode_image_prompt

    images, converted = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            converted.append(_message_text(message, i))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url":
                images.append(_data_url_image(part, where))
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise ApiError(f"{where} has type {kind!r}: expected 'text' or 'image_url'", param="messages")
        converted.append({**_message_text({**message, "content": ""}, i), "content": parts})
    if chat_template is None and not getattr(processor, "chat_template", None):
        raise ApiError("this model's processor has no chat template: start the server with --chat-template",
                       param="messages")
    _check_template_reads(lambda kwargs: processor.apply_chat_template(
        converted, add_generation_prompt=True, chat_template=chat_template, tokenize=False, **kwargs),
        template_kwargs, read or [])
    return encode_image_prompt(processor, converted, images, chat_template, template_kwargs)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values; the chat template reads them
UNREAD_BY_TEMPLATE = {
    "tools": "tools: this model's chat template does not show tools to the model (its prompt is the same without "
             "them): start the server with a --chat-template that renders `tools`",
    "reasoning_effort": "reasoning_effort: this model's chat template does not read it (its prompt is the same "
                        "without it), so it would change nothing: leave it out for this model",
}


def _check_template_reads(render: Any, template_kwargs: dict[str, Any], fields: list[str]) -> None:
    """Refuse request fields (`tools`, `reasoning_effort`) the chat template leaves out of the prompt (`render(kwargs)`
    is the prompt's text): the model could not know them."""
    if not fields:
        return
    prompt = render(template_kwargs)
    for name in fields:
        if prompt == render({k: v for k, v in template_kwargs.items() if k != name}):
            raise ApiError(UNREAD_BY_TEMPLATE[name], param=name)


def chat_prompt(
    body: dict[str, Any], tokenizer: PreTrainedTokenizerBase, chat_template: str | None, processor: Any = None,
    template_kwargs: dict[str, Any] | None = None, tools: ToolRequest | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the (1, n) ids of a chat request's messages through the chat template, the assistant's turn opened; the
    prompt's extra model inputs). Messages with `image_url` parts (base64 data URLs) go through `processor`, a
    vision-language target's: the extra inputs are then its images (`pixel_values`, ...); else they are empty.
    The template gets the server's `template_kwargs` updated by the request's `reasoning_effort` (gpt-oss-style
    templates read it), its `chat_template_kwargs` (vLLM's field: `{"enable_thinking": false}`, ...) and its `tools`;
    the tools and the reasoning effort must change the prompt (else the model could not know them: refused)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(f"messages={messages!r}: expected a non-empty list of {{role, content}}", param="messages")
    asked = body.get("chat_template_kwargs") or {}
    if not isinstance(asked, dict):
        raise ApiError(f"chat_template_kwargs={asked!r}: expected an object of the chat template's keywords",
                       param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(f"reasoning_effort={effort!r}: expected one of {', '.join(REASONING_EFFORTS)}",
                       param="reasoning_effort")
    template_kwargs = {**(template_kwargs or {}), **({"reasoning_effort": effort} if effort else {}), **asked,
                       **({"tools": tools.tools} if tools else {})}
    # request fields the template must read (its prompt changes with them), else the model could not know them
    read = (["tools"] if tools is not None and tools.parses_calls else []) + (
        ["reasoning_effort"] if effort and "reasoning_effort" not in asked else [])
    if _has_images(messages):
        if processor is None:
            raise ApiError("messages hold image_url parts, but this model takes no images (a text target)",
                           param="messages")
        return _image_chat_prompt(messages, processor, chat_template, template_kwargs, read)
    texts = [_message_text(m, i) for i, m in enumerate(messages)]
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions, or start the server with "
                       "--chat-template", param="messages")
    _check_template_reads(lambda kwargs: tokenizer.apply_chat_template(
        texts, add_generation_prompt=True, chat_template=chat_template, tokenize=False, **kwargs),
        template_kwargs, read)
    return tokenizer.apply_chat_template(texts, add_generation_prompt=True, chat_template=chat_template,
                                         return_tensors="pt", return_dict=True, **template_kwargs)["input_ids"], {}


def completion_prompt(body: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """The (1, n) ids of a completions request's prompt: one string, or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt, return_tensors="pt").input_ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return torch.tensor([prompt])
    raise ApiError(f"prompt={prompt!r}: expected a non-empty string or list of token ids (one prompt per request)",
                   param="prompt")


def parse_request(
    body: Any, chat: bool, tokenizer: PreTrainedTokenizerBase, defaults: dict[str, Any],
    chat_template: str | None = None, processor: Any = None, template_kwargs: dict[str, Any] | None = None,
    tool_parser: str | None = None, generation_config: Any = None,
) -> ParsedRequest:
    """Check a request body and turn it into a `ParsedRequest`.

    Args:
        body: the decoded JSON body.
        chat: a `/v1/chat/completions` request (else `/v1/completions`).
        defaults: the server's `generate` options, for the fields a request leaves out.
        chat_template: a Jinja template used instead of the tokenizer's.
        processor: a vision-language target's processor: chat messages may then hold `image_url` parts.
        template_kwargs: the server's chat template keywords (a request's `chat_template_kwargs` update them).
        tool_parser: the name of the parser that reads tool calls out of answers (`tool_parsers.PARSERS`; None: no
            parser, so `tool_choice` "auto" is refused while "required" and named functions still work).
        generation_config: the target's, whose EOS `stop_token_ids` add to (None: the tokenizer's EOS).
    """
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, (harmless, why) in REFUSED.items():
        if body.get(name) not in harmless:
            raise ApiError(f"{name}={body[name]!r} is not supported: {why}", param=name)
    n = _number(body, "n", int, 1, MAX_CHOICES) or 1
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise ApiError(f"best_of={best_of!r} is not supported: choices are not ranked (ask for n={best_of} and pick)",
                       param="best_of")
    tools = _tools(body, chat, tool_parser)
    from jinja2 import TemplateError

    try:
        input_ids, inputs = chat_prompt(body, tokenizer, chat_template, processor, template_kwargs, tools) if chat else (
            completion_prompt(body, tokenizer), {})
    except TemplateError as err:  # the template's raise_exception ("roles must alternate", ...): the request's fault
        raise ApiError(f"the chat template refused the messages: {err}", param="messages") from err

    options = dict(defaults)
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
    if max_tokens is not None:
        options["max_new_tokens"] = max_tokens
    temperature = _number(body, "temperature", float, 0, 2)
    if temperature is not None:  # 0: greedy, the target's own argmax path; else sampling from its distribution
        options["do_sample"] = temperature > 0
        options["temperature"] = temperature if temperature > 0 else None
    for name, kind, low, high, low_open in (("top_p", float, 0, 1, True), ("min_p", float, 0, 1, False),
                                            ("repetition_penalty", float, 0, None, True)):
        value = _number(body, name, kind, low, high, low_open)
        if value is not None:
            options[name] = value
    min_tokens = _number(body, "min_tokens", int, 0)  # vLLM's: EOS is banned until the answer has this many tokens
    if min_tokens:
        options["min_new_tokens"] = min_tokens
    ignore_eos = body.get("ignore_eos", False)  # vLLM's: EOS is an ordinary token, the answer runs to max_tokens
    if not isinstance(ignore_eos, bool):
        raise ApiError(f"ignore_eos={ignore_eos!r}: expected true or false", param="ignore_eos")
    stop_token_ids = body.get("stop_token_ids") or []  # vLLM's: these end the answer too (kept in it, as EOS is)
    if not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer) for t in stop_token_ids):
        raise ApiError(f"stop_token_ids={stop_token_ids!r}: expected a list of token ids in [0, {len(tokenizer)})",
                       param="stop_token_ids")
    if ignore_eos or stop_token_ids:  # the answer's end tokens: the target's EOS (unless ignored) and these
        if ignore_eos:
            eos = []
        elif generation_config is not None:
            eos = eos_ids(options.get("eos_token_id"), generation_config)
        else:
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        options["eos_token_id"] = eos + [t for t in stop_token_ids if t not in eos]
    top_k = _number(body, "top_k", int, -1)
    if top_k is not None:
        options["top_k"] = max(top_k, 0)  # vLLM's -1 and transformers' 0 both mean no top-k cut
    stop = _stop_strings(body)
    options["stop_strings"] = (options.get("stop_strings") or []) + stop or None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"stream={stream!r}: expected true or false", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(f"stream_options={stream_options!r}: expected an object", param="stream_options")
    logprobs = _logprobs(body, chat)
    field_name, (json_schema, regex, json_object) = structured_output(body)
    if tools is not None and tools.forced:  # the answer is the calls' JSON
        if field_name is not None:
            raise ApiError(f"{field_name} and tool_choice={body.get('tool_choice')!r} both constrain the answer: "
                           "send one of them", param=field_name)
        field_name, json_schema = "tool_choice", tools.schema()
    return ParsedRequest(
        input_ids=input_ids, options=options, stop=options["stop_strings"] or [], stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)), seed=_number(body, "seed", int),
        json_schema=json_schema, json_object=json_object, regex=regex, constraint_field=field_name or "response_format",
        logprobs=logprobs, n=n, inputs=inputs, tools=tools,
        presence_penalty=_number(body, "presence_penalty", float, -2, 2) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", float, -2, 2) or 0.0,
        logit_bias=_logit_bias(body.get("logit_bias"), len(tokenizer)), prediction=prediction_tokens(body, tokenizer),
        messages=body["messages"] if chat else None,
    )


def _logit_bias(bias: Any, vocab_size: int) -> dict[int, float]:
    """{token id: bias} of a `logit_bias` object ({"token id": -100..100}, OpenAI's form)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ApiError(f"logit_bias={bias!r}: expected an object of token ids to biases", param="logit_bias")
    checked = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or token >= vocab_size:
            raise ApiError(f"logit_bias: token {key!r} is not a token id in [0, {vocab_size})", param="logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
            raise ApiError(f"logit_bias[{key!r}]={value!r}: expected a number from -100 to 100", param="logit_bias")
        checked[token] = float(value)
    return checked


def _tools(body: dict[str, Any], chat: bool, tool_parser: str | None) -> ToolRequest | None:
    """The request's checked `tools` / `tool_choice` / `parallel_tool_calls` (None: no tools)."""
    if not chat:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise ApiError(f"{name} is a chat field: send tools to /v1/chat/completions", param=name)
        return None
    try:
        tools = tool_request(body)
    except ToolRequestError as err:
        raise ApiError(str(err), param=err.param) from err
    if tools is not None and tools.choice == "auto" and tool_parser is None:
        raise ApiError("tool_choice='auto' needs a tool-call parser, and this model's chat template shows no call "
                       "format this server knows: start it with --tool-call-parser (hermes, qwen3_coder, llama3_json, "
                       "pythonic, mistral), or ask for tool_choice 'required' or a named function (the answer is then "
                       "constrained to the calls' JSON)", param="tool_choice")
    return tools


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many rival tokens to list per token, or None for no log-probabilities (chat: `logprobs` true and
    `top_logprobs` 0-20; completions: `logprobs` 0-5)."""
    if not chat:
        return _number(body, "logprobs", int, 0, 5)
    wanted = body.get("logprobs", False)
    if wanted not in (None, True, False):
        raise ApiError(f"logprobs={wanted!r}: expected true or false (chat; top_logprobs sets the count)",
                       param="logprobs")
    top = _number(body, "top_logprobs", int, 0, 20)
    if top is not None and not wanted:
        raise ApiError(f"top_logprobs={top} needs logprobs=true", param="top_logprobs")
    return (top or 0) if wanted else None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, tokenizer: PreTrainedTokenizerBase,
                   chat: bool, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs` object of the generated `tokens` from the target's (T, V) raw logits at each step
    (completions: their `text_offset`s counted from `text_offset`, where the first token's text starts)."""
    if not tokens:
        return {"content": []} if chat else {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    chosen = log_probs.gather(1, torch.tensor(tokens, device=log_probs.device)[:, None])[:, 0].tolist()
    rivals_lp, rivals = log_probs.topk(top, dim=-1) if top else (log_probs[:, :0], log_probs[:, :0].long())
    text = [tokenizer.decode([t]) for t in tokens]
    if chat:
        def entry(piece: str, value: float) -> dict[str, Any]:
            return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

        return {"content": [
            {**entry(text[i], chosen[i]),
             "top_logprobs": [entry(tokenizer.decode([r]), v) for r, v in zip(rivals[i].tolist(), rivals_lp[i].tolist())]}
            for i in range(len(tokens))]}
    offsets, position = [], text_offset
    for piece in text:
        offsets.append(position)
        position += len(piece)
    return {"tokens": text, "token_logprobs": chosen, "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([r]): v for r, v in zip(rivals[i].tolist(), rivals_lp[i].tolist())}
                             for i in range(len(tokens))]}


def answer_tokens(tokenizer: PreTrainedTokenizerBase, tokens: list[int], text: str) -> int:
    """How many of the generated `tokens` make up the answer `text`: the fewest whose decoded text covers it. A stop
    string's tokens (the text ends before it) and a final EOS (decoded to nothing) fall outside, as in OpenAI's
    log-probabilities, which list the answer's own tokens."""
    if len(tokenizer.decode(tokens, skip_special_tokens=True)) <= len(text):  # nothing cut: all but a trailing EOS
        count = len(tokens)
        while count and not tokenizer.decode(tokens[count - 1:count], skip_special_tokens=True):
            count -= 1
        return count
    for count in range(len(tokens) + 1):
        if len(tokenizer.decode(tokens[:count], skip_special_tokens=True)) >= len(text):
            return count
    return len(tokens)


def tokens_covering(tokenizer: PreTrainedTokenizerBase, tokens: list[int], length: int) -> int:
    """The fewest of the generated `tokens` whose decoded text reaches `length` characters (a reasoning block's
    tokens: `usage.completion_tokens_details.reasoning_tokens`), found by bisection."""
    low, high = 0, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(tokens[:middle], skip_special_tokens=True)) >= length:
            high = middle
        else:
            low = middle + 1
    return low


def finish_reason(stopped_by_string: bool, new_tokens: list[int], max_new_tokens: int, eos: set[int],
                  called_tools: bool = False) -> str:
    """OpenAI's finish_reason: "length" when the answer hit max_tokens without ending, else "tool_calls" when it
    holds tool calls, else "stop"."""
    if called_tools and not stopped_by_string:
        return "tool_calls"
    if stopped_by_string or (new_tokens and new_tokens[-1] in eos) or len(new_tokens) < max_new_tokens:
        return "stop"
    return "length"


def response_body(chat: bool, model: str, choices: list[Choice], usage: dict[str, Any],
                  stats: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer; `specheads` carries the speculation statistics."""
    body_choices = []
    for index, choice in enumerate(choices):
        entry: dict[str, Any] = {"index": index, "finish_reason": choice.finish_reason, "logprobs": choice.logprobs}
        if chat:
            # content is null when the answer is only calls, as OpenAI's
            entry["message"] = {"role": "assistant", "content": (choice.text or None) if choice.tool_calls else choice.text}
            if choice.tool_calls:
                entry["message"]["tool_calls"] = [call.body() for call in choice.tool_calls]
            if choice.reasoning is not None:  # DeepSeek's and vLLM's field
                entry["message"]["reasoning_content"] = choice.reasoning
        else:
            entry["text"] = choice.text
        body_choices.append(entry)
    return {"id": new_id(chat), "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": body_choices, "usage": usage, "specheads": stats}


def chunk_body(chat: bool, request_id: str, model: str, text: str | None = None, reason: str | None = None,
               first: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None,
               tool_calls: list[CallDelta] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """One streamed piece of choice `index` (the first of a chat carries the role; the last the finish_reason),
    with the log-probabilities of the tokens that piece's text is made of, when asked for, or a piece of the
    answer's reasoning, or pieces of its tool calls (inference/tool_call_stream.py: a call's first piece carries its
    id and name, the others argument text that clients join)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": logprobs}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [call.body() for call in tool_calls]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
