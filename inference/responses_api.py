"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat completions machinery of `specheads serve`.

Newer OpenAI clients (the Agents SDK, Codex-style tools) speak the Responses API rather than chat completions. A
request is read into the chat completions body it asks for (`chat_body`): `instructions` become the first system
message, `input` (a string, or a list of message, `function_call`, `function_call_output` and `reasoning` items)
the messages, `max_output_tokens` / `text.format` / `reasoning.effort` / function `tools` their chat names; so every
check, the chat template, the tool-call and reasoning parsers and the answer itself are the chat endpoint's (greedy:
`target.generate`'s). The answer comes back as a response object (`response_object`): a `reasoning` item (the think
block), a `message` item with the `output_text`, and a `function_call` item per call; `status` "incomplete" when
`max_output_tokens` cut it. Streamed, as the typed events of the Responses API (`ResponseEvents`): text and reasoning
deltas as they are sure (as the chat stream sends them), each call as it is written (inference/tool_call_stream.py).

Responses are stored (unless `store: false`) so that `previous_response_id` continues a conversation
(inference/response_store.py); `conversation` objects are refused by name, as are `background` runs and `include` /
`top_logprobs` (not produced here); `metadata` is accepted and returned.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from .openai_api import Choice
from .openai_errors import ApiError
from .tool_call_stream import CallDelta
from .tool_calls import ToolCall

REFUSED = {  # fields whose answer this server cannot give: refused by name, never ignored
    # (previous_response_id is read before: inference/response_store.py)
    "conversation": "conversation objects are not stored: use previous_response_id or send the whole conversation "
                    "as input",
    "background": "background responses are not supported",
    "include": "no extra output (include) is produced",
    "top_logprobs": "log-probabilities are not returned by /v1/responses (use /v1/chat/completions)",
    "prompt": "stored prompt templates are not supported",
}
PASSED_ON = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "top_k", "min_p",
             "repetition_penalty", "seed", "stop", "chat_template_kwargs")  # the same name in a chat request


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_body(body: Any) -> dict[str, Any]:
    """The /v1/chat/completions body a Responses request asks for; an `ApiError` names a field it cannot read."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, []):
            raise ApiError(f"{name}: {why}", param=name)
    if (body.get("truncation") or "disabled") != "disabled":
        raise ApiError(f"truncation={body['truncation']!r}: only 'disabled' (a prompt past the context is refused)",
                       param="truncation")
    chat = {key: body[key] for key in PASSED_ON if key in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(f"instructions={instructions!r}: expected a string", param="instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(
        body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input`: a string (one user message) or a list of items."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(f"input={items!r}: expected a non-empty string or list of items", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items' text, for the assistant turn that follows them
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message = {"role": item.get("role"), "content": _content(item.get("content"), f"input[{i}].content")}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": "\n".join(reasoning)} if reasoning else {})})
                reasoning = []
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":  # its full text when it has it, else its summary
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("\n".join(str(part.get("text", "")) for part in parts if isinstance(part, dict)))
        else:
            raise ApiError(f"input[{i}]={item!r}: expected a message, function_call, function_call_output or "
                           "reasoning item", param="input")
    return messages


def _content(content: Any, where: str) -> Any:
    """A message item's content as a chat message's: a string, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where}={content!r}: expected a string or a list of content parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ApiError(f"{where}[{j}] has type {kind!r}: expected input_text, output_text or input_image (a data "
                           "URL in image_url)", param="input")
    return parts


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) as chat tools."""
    if not isinstance(tools, list):
        raise ApiError(f"tools={tools!r}: expected a list of function tools", param="tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(f"tools[{i}]={tool!r}: only function tools are supported (no built-in tools such as "
                           "web_search or file_search)", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    """A Responses tool_choice as a chat one ({"type": "function", "name"} names the function at the top level)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text_format: Any) -> dict[str, Any]:
    """`text.format` ({"type": "text" | "json_object" | "json_schema", "schema", ...}) as a chat response_format."""
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": text_format.get("name", "answer"),
                                                       "schema": text_format.get("schema")}}
    return text_format


def output_items(choice: Choice, item_ids: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """A choice's Responses output: its reasoning item, message item and function calls (`item_ids`: the ids a
    stream already gave the reasoning and message items)."""
    ids = item_ids or {}
    items: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        items.append({"type": "reasoning", "id": ids.get("reasoning") or new_item_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": choice.reasoning}]})
    if choice.text or not choice.tool_calls:
        items.append(message_item(ids.get("message") or new_item_id("msg"), choice.text, "completed"))
    return items + [call_item(call) for call in choice.tool_calls]


def call_item(call: ToolCall) -> dict[str, Any]:
    """A tool call as a `function_call` output item (its id follows from the call's)."""
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def response_object(response_id: str, created: int, body: dict[str, Any], model: str, choice: Choice | None = None,
                    usage: dict[str, Any] | None = None, stats: dict[str, Any] | None = None,
                    item_ids: dict[str, str] | None = None) -> dict[str, Any]:
    """The response object: in progress (no `choice` yet) or finished ("incomplete" when max_output_tokens cut it)."""
    status = "in_progress" if choice is None else ("incomplete" if choice.finish_reason == "length" else "completed")
    response: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": [] if choice is None else output_items(choice, item_ids), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
        "store": body.get("store", True) is not False, "previous_response_id": body.get("previous_response_id"),
        "usage": None,
    }
    if usage is not None:
        response["usage"] = {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]},
        }
        response["specheads"] = stats
    return response


class ResponseEvents:
    """The typed server-sent events of one streamed response, written through `write(event_type, payload)`.

    `created` opens the stream, `piece` sends the answer's text, reasoning and tool calls as they come (each part's
    item opened at its first piece; a call's `function_call` item at its name, then its arguments' pieces as
    `response.function_call_arguments.delta`), `finish` sends what was held back, closes the items and sends the
    finished response.
    """

    def __init__(self, write: Callable[[str, dict[str, Any]], None], body: dict[str, Any], model: str) -> None:
        self._write, self.body, self.model = write, body, model
        self.response_id, self.created_at = new_item_id("resp"), int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the items opened so far, in output order
        self.open: dict[str, Any] | None = None  # the item receiving pieces ("reasoning" or "message")
        self.texts: dict[str, str] = {}  # item id -> the text sent in it
        self.item_ids: dict[str, str] = {}  # "reasoning" / "message" -> its item's id
        self.calls: list[tuple[dict[str, Any], int]] = []  # per streamed call: its function_call item, output index

    def send(self, event_type: str, **payload: Any) -> None:
        self._write(event_type, {"type": event_type, "sequence_number": self.sequence, **payload})
        self.sequence += 1

    def created(self) -> None:
        response = response_object(self.response_id, self.created_at, self.body, self.model)
        self.send("response.created", response=response)
        self.send("response.in_progress", response=response)

    def piece(self, text: str | None, reasoning: str | None = None, calls: list[CallDelta] | None = None) -> None:
        """The answer's next reasoning and content text (either may be empty) and pieces of its calls."""
        if reasoning:
            self._delta("reasoning", reasoning)
        if text:
            self._delta("message", text)
        for delta in calls or []:
            if delta.id is not None:  # a new call: its item opens (the content before it is done)
                self._close()
                item = {**call_item(ToolCall(delta.name, "", delta.id)), "status": "in_progress"}
                self.calls.append((item, len(self.items)))
                self.items.append(item)
                self.send("response.output_item.added", output_index=len(self.items) - 1, item=item)
            item, index = self.calls[delta.index]
            if delta.arguments:
                item["arguments"] += delta.arguments
                self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=delta.arguments)

    def _delta(self, kind: str, text: str) -> None:
        if self.open is None or self.open["type"] != kind:
            self._close()
            self._open(kind)
        item_id, index = self.open["id"], len(self.items) - 1
        self.texts[item_id] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        self.send(event, item_id=item_id, output_index=index, content_index=0, delta=text)

    def _open(self, kind: str) -> None:
        item_id = new_item_id("rs" if kind == "reasoning" else "msg")
        self.item_ids[kind], self.texts[item_id] = item_id, ""
        item = ({"type": "reasoning", "id": item_id, "summary": [], "content": []} if kind == "reasoning"
                else message_item(item_id, "", "in_progress"))
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        self.send("response.output_item.added", output_index=index, item=item)
        part = {"type": "reasoning_text" if kind == "reasoning" else "output_text", "text": ""}
        if kind == "message":
            part["annotations"] = []
        self.send("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)

    def _close(self) -> None:
        """Close the item receiving pieces (its text done, its part and the item complete)."""
        if self.open is None:
            return
        item, index = self.open, len(self.items) - 1
        text = self.texts[item["id"]]
        if item["type"] == "reasoning":
            self.send("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text)
            part, done = {"type": "reasoning_text", "text": text}, {**item, "content": [
                {"type": "reasoning_text", "text": text}]}
        else:
            self.send("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            part = {"type": "output_text", "text": text, "annotations": []}
            done = message_item(item["id"], text, "completed")
        self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        self.send("response.output_item.done", output_index=index, item=done)
        self.open = None

    def finish(self, choice: Choice, usage: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
        """Send what was held back, close the items, finish each call, then the finished response (returned)."""
        self.piece(choice.unsent, choice.unsent_reasoning, choice.unsent_calls)
        if not choice.tool_calls and "message" not in self.item_ids:
            self._delta("message", "")  # an empty answer still has its message item
        self._close()
        for (item, index), call in zip(self.calls, choice.tool_calls):
            done = call_item(call)
            self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=call.arguments)
            self.send("response.output_item.done", output_index=index, item=done)
        response = response_object(self.response_id, self.created_at, self.body, self.model, choice, usage, stats,
                                   self.item_ids)
        self.send("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                  response=response)
        return response


def event_bytes(event_type: str, payload: dict[str, Any]) -> bytes:
    """One Responses server-sent event: `event: <type>` then `data: <json>`."""
    return f"event: {event_type}\ndata: {json.dumps(payload)}\n\n".encode()
