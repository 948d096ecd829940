"""A multi-turn conversation with a `SpeculativeLM`: history, chat template, and the target cache between turns.

Each turn renders the whole history through the tokenizer's chat template, as a chat client does, and generates with
one `PromptCache` for the conversation, so the target runs only what the previous turn did not leave in its cache
(the new user message and the template's tokens around it). The answer is the target's own (greedy: identical to
`target.generate` on the rendered conversation; sampling: its distribution); the history keeps its decoded text.

With a vision-language target's `processor`, a message may show images (`ask(text, images=[...])`): the processor
renders the conversation and every turn gives the target all of the conversation's images, as transformers'
generate takes them; the cache is reused while the images stay the same (`PromptCache.prefill`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import PreTrainedTokenizerBase, TextStreamer

from .answer_parts import AnswerParts
from .prompt_cache import PromptCache
from .reasoning import ThinkParser
from .tool_calls import ToolCall, template_message, tool_request
from .tool_parsers import PARSERS, detect_parser, make_parser


def read_chat_template(value: str) -> str:
    """A Jinja chat template given as a file path or as the template text itself."""
    path = Path(value)
    if "{" not in value and not path.is_file():
        raise FileNotFoundError(f"chat template {value!r} is neither a file nor a Jinja template")
    return path.read_text() if "{" not in value else value


class ChatSession:
    """A conversation: `ask(text)` adds a user message, generates the answer, adds it, returns its text; with `tools`,
    the answer's calls are `last_calls`, and `add_tool_result(call_id, text)` then `reply()` go on after them.

    Args:
        lm: the `SpeculativeLM` that answers.
        tokenizer: default `lm.tokenizer`; it needs a chat template (or pass `chat_template`).
        system: an optional system message, first in the history (kept by `reset`).
        chat_template: a Jinja template used instead of the tokenizer's.
        reuse_cache: keep the target's cache between turns (`PromptCache`); False runs the whole conversation
            every turn (the reference).
        processor: a vision-language target's processor (`multimodal.image_processor_for`): messages may then show
            images, and it renders the conversation (its chat template unless `chat_template` is given).
        chat_template_kwargs: keywords of the chat template (`enable_thinking=False`, ...).
        tools: OpenAI-style function tools (`{"type": "function", "function": {"name", "description", "parameters"}}`)
            the chat template shows the model: each answer's calls are read out of it (`last_calls`, and the history's
            assistant turn holds them), and `add_tool_result` + `reply` continue after them (inference/tool_calls.py).
        tool_parser: how calls are read (inference/tool_parsers.py): "auto" (the format the chat template shows) or a
            parser's name.
        **generate_options: passed to every `lm.generate` call (max_new_tokens, do_sample, temperature, stop_strings,
            logits_processor, ...).

    After each turn `last_stats` holds `lm.last_stats` (tau, tokens/s, `reused_prompt_tokens`) plus
    `prompt_tokens`, the length of the rendered conversation.
    """

    def __init__(
        self,
        lm: Any,
        tokenizer: PreTrainedTokenizerBase | None = None,
        system: str | None = None,
        chat_template: str | None = None,
        reuse_cache: bool = True,
        processor: Any | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_parser: str = "auto",
        **generate_options: Any,
    ) -> None:
        self.lm = lm
        self.processor = processor
        self.template_kwargs = dict(chat_template_kwargs or {})
        if tokenizer is None and processor is not None:
            tokenizer = processor.tokenizer
        self.tokenizer = tokenizer if tokenizer is not None else lm.tokenizer
        if self.tokenizer is None:
            raise ValueError("ChatSession needs a tokenizer: pass tokenizer= or build the SpeculativeLM with one")
        self.chat_template = chat_template
        renderer = self.tokenizer if processor is None else processor
        if chat_template is None and not getattr(renderer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {getattr(self.tokenizer, 'name_or_path', '?')!r} has no chat template; pass "
                "chat_template= (CLI: --chat-template FILE_OR_TEMPLATE)"
            )
        self.system = system
        self.generate_options = generate_options
        self.tools, self.tool_parser = self._tools(tools, tool_parser, renderer)
        self.last_calls: list[ToolCall] = []  # the calls the last answer made (with `tools`)
        self.cache = PromptCache() if reuse_cache else None
        self.messages: list[dict[str, Any]] = []
        self.images: list[Any] = []  # the conversation's images (PIL), in the order its messages show them
        self.last_stats: dict[str, Any] = {}
        self.reset()

    def _tools(self, tools: list[dict[str, Any]] | None, parser: str, renderer: Any) -> tuple[Any, Any]:
        """The checked `ToolRequest` and its parser (None, None without tools); a template that does not show the
        tools, or shows no call format known here, is refused by name."""
        if not tools:
            return None, None
        if self.processor is not None:
            raise ValueError("ChatSession: tools with a vision-language processor are not supported")
        request = tool_request({"tools": tools})  # a ValueError (ToolRequestError) names a malformed tool
        template = self.chat_template or renderer.chat_template
        name = detect_parser(template) if parser == "auto" else parser
        if name is None:
            raise ValueError("ChatSession(tools=...): the chat template shows no tool-call format known here; pass "
                             f"tool_parser= (one of {', '.join(PARSERS)})")
        probe = [{"role": "user", "content": "?"}]
        if self._render_text(probe, request.tools) == self._render_text(probe, None):
            raise ValueError("ChatSession(tools=...): the chat template leaves the tools out of the prompt, so the model "
                             "could not know them; pass a chat_template that renders `tools`")
        return request, make_parser(name)

    def _render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=self.chat_template,
                                                  tokenize=False, **({"tools": tools} if tools else {}),
                                                  **self.template_kwargs)

    def reset(self) -> None:
        """Start a new conversation (the system message stays)."""
        self.messages = [] if self.system is None else [self._message("system", self.system)]
        self.images = []
        if self.cache is not None:
            self.cache.reset()

    def _message(self, role: str, text: str, images: int = 0) -> dict[str, Any]:
        if self.processor is None:
            return {"role": role, "content": text}
        return {"role": role, "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}

    def render(self) -> torch.Tensor:
        """The conversation so far with the assistant's turn opened: (1, n) ids."""
        return self.render_with_inputs()[0]

    def render_with_inputs(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The conversation so far with the assistant's turn opened: ((1, n) ids, the extra inputs of its images)."""
        if self.processor is not None:
            from .multimodal import encode_image_prompt

            return encode_image_prompt(self.processor, self.messages, self.images, self.chat_template,
                                       self.template_kwargs)
        tools = {} if self.tools is None else {"tools": self.tools.tools}
        messages = [{**message, **template_message(message)} for message in self.messages]  # calls' arguments as objects
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, chat_template=self.chat_template, return_tensors="pt",
            return_dict=True, **tools, **self.template_kwargs,
        )["input_ids"], {}

    def ask(self, text: str, streamer: Any | None = None, images: list[Any] | None = None) -> str:
        """Add the user message `text` (showing `images`: PIL images or file paths, before the text), generate the
        answer (streamed to `streamer` if given), return its text."""
        if not text.strip():
            raise ValueError("a chat message must hold some text, got an empty one")
        if images and self.processor is None:
            raise ValueError("this ChatSession has no processor, so its messages cannot show images; pass the "
                             "vision-language target's processor (processor=...)")
        shown = []
        if images:
            from .multimodal import load_images

            shown = load_images(list(images))
        self.messages.append(self._message("user", text, len(shown)))
        self.images += shown
        try:
            return self._answer(streamer)
        except BaseException:
            self.messages.pop()  # the turn did not happen (an error, Ctrl-C): the history stays as it was
            del self.images[len(self.images) - len(shown):]
            raise

    def add_tool_result(self, call_id: str, content: str, name: str | None = None) -> None:
        """Add a tool's result to the history: the answer to the call `call_id` of the last answer (`last_calls`);
        then `reply()` has the model go on."""
        if not any(call.id == call_id for call in self.last_calls):
            known = ", ".join(call.id for call in self.last_calls) or "none"
            raise ValueError(f"call_id={call_id!r} is not a call of the last answer (its calls: {known})")
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": content,
                              **({"name": name} if name else {})})

    def reply(self, streamer: Any | None = None) -> str:
        """Generate the next assistant turn after the history as it is (the tools' results added), add it, return
        its text."""
        if not self.messages or self.messages[-1]["role"] != "tool":
            raise ValueError("reply() goes on after tool results (add_tool_result); to say something, use ask(text)")
        return self._answer(streamer)

    def regenerate(self, streamer: Any | None = None) -> str:
        """Answer the last user message again: its answer leaves the history, a new one (another draw when sampling)
        takes its place; returns its text. The cache reuses the conversation before that message (a hybrid target's
        too: its states are kept where the turn started, `PromptCache.checkpoints`)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ValueError("regenerate() answers the last user message again; the conversation ends with no answer "
                             f"(last message: {self.messages[-1]['role'] if self.messages else 'none'})")
        dropped = self.messages.pop()
        try:
            return self._answer(streamer)
        except BaseException:
            self.messages.append(dropped)  # no new answer (an error, Ctrl-C): the old one stays
            raise

    def _answer(self, streamer: Any | None) -> str:
        """Generate the assistant's turn after the history, add it (its calls read out when the session has tools),
        return its text (the content, with tools)."""
        input_ids, inputs = self.render_with_inputs()
        out = self.lm.generate(input_ids.to(self.lm.target.device), prompt_cache=self.cache, streamer=streamer,
                               **inputs, **self.generate_options)
        answer = self.tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
        self.last_calls = []
        if self.tools is None:
            self.messages.append(self._message("assistant", answer))
        else:
            parts = AnswerParts(self.tools, self.tool_parser).finish(answer)
            answer, self.last_calls = parts.content, parts.calls
            self.messages.append({"role": "assistant", "content": answer,
                                  **({"tool_calls": [call.body() for call in parts.calls]} if parts.calls else {})})
        self.last_stats = {**self.lm.last_stats, "prompt_tokens": int(input_ids.shape[1])}
        return answer


DIM, PLAIN = "\033[2m", "\033[0m"  # ANSI: faint text, then back to normal


class ReasoningStreamer(TextStreamer):
    """Prints a reasoning model's streamed answer with its think block apart from the answer proper (`specheads chat`).

    The answer is read as the server reads it (`answer_parts.AnswerParts` with a `ThinkParser`; a generation prompt
    that ends with `<think>` opens the block): the reasoning is printed without its tags, dimmed on a terminal, then a
    blank line and the answer; with `show_reasoning=False` it is left out and `reasoning_chars` says how long it was.
    An answer without a block prints as it comes.

    Args:
        tokenizer: decodes the tokens (special tokens skipped).
        show_reasoning: print the reasoning (True) or leave it out (False).
        dim: dim the reasoning (default: when `out` is a terminal).
        out: where to print (default: stdout).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, show_reasoning: bool = True, dim: bool | None = None,
                 out: TextIO | None = None) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.show_reasoning = show_reasoning
        self.out = out if out is not None else sys.stdout
        self.dim = self.out.isatty() if dim is None else dim
        self.parts = AnswerParts(reasoning_parser=ThinkParser())
        self.text = ""  # the answer so far
        self.reasoning_chars = 0  # the reasoning's length (printed or not)
        self.printing = None  # "reasoning" or "content": what the last printed piece was

    def put(self, value: torch.Tensor) -> None:
        if self.next_tokens_are_prompt:  # the prompt: does its generation prompt open the block?
            parser = ThinkParser()
            opened = parser.opens_in_prompt(self.tokenizer.decode(value.reshape(-1)[-8:].tolist()))
            self.parts = AnswerParts(reasoning_parser=parser, opened=opened)
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        reasoning, content = self.parts.feed(text)
        if stream_end:
            parts = self.parts.finish(self.text)
            reasoning, content = reasoning + parts.unsent_reasoning, content + parts.unsent_content
        self.reasoning_chars += len(reasoning)
        if reasoning and self.show_reasoning:
            self._write("reasoning", reasoning)
        if content:
            self._write("content", content)
        if stream_end:
            self._write(None, "\n")
        self.out.flush()

    def _write(self, part: str | None, text: str) -> None:
        """Print `text` of `part` ("reasoning", "content"; None: the answer's end), a blank line between the two."""
        if self.printing == "reasoning" and part != "reasoning":  # the block ended
            self.out.write((PLAIN if self.dim else "") + ("\n\n" if part == "content" else ""))
        elif part == "reasoning" and self.printing != "reasoning" and self.dim:
            self.out.write(DIM)
        self.out.write(text)
        self.printing = part
