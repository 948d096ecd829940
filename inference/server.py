"""`specheads serve`: an OpenAI-compatible HTTP server over a `SpeculativeLM` (Python's standard library only).

    specheads serve --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3 --port 8000

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both with `"stream": true` as server-sent events),
`POST /v1/responses` (OpenAI's Responses API, read as the chat request it asks for: inference/responses_api.py; stored
responses for `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`:
inference/response_store.py), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text: requests, tokens, forwards, accepted drafts). Any
OpenAI client works (`base_url="http://127.0.0.1:8000/v1"`). Answers are the
target's own, as `generate` gives them: greedy (`temperature` 0) identical to `target.generate`, sampling from its
distribution. Each answer carries `specheads` statistics (tau, reused prompt tokens, tokens/s).

Concurrent requests are batched continuously (`ServingLoop`, inference/serving_loop.py): a request that arrives
while others are generating joins their batch at the next round, and one target forward verifies every row's tree
(up to `max_batch` rows; the others wait for a row to end; on CUDA requests run one at a time on the fast path,
`batching`). Each answer is still exactly its own prompt's. The
target's cache is kept between requests in a `PromptCachePool`: a chat client re-sends the whole conversation every
turn, and only the part the previous turn did not leave in a slot runs through the target.
"""

from __future__ import annotations

import hmac
import json
import queue
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from .answer_parts import AnswerParts
from .json_object import json_object_constraint
from .openai_api import (
    ApiError,
    Choice,
    ParsedRequest,
    answer_tokens,
    chunk_body,
    finish_reason,
    new_id,
    parse_request,
    response_body,
    sse,
    token_logprobs,
    tokens_covering,
)
from .openai_penalties import LogitBias, OccurrencePenalties
from .predicted_outputs import prediction_usage
from .prompt_cache import PromptCachePool
from .reasoning import detect_reasoning_parser, make_reasoning_parser
from .response_store import ResponseStore
from .responses_api import ResponseEvents, chat_body, event_bytes, new_item_id, response_object
from .serving_loop import COUNTERS, LABELED_COUNTERS, ServingLoop
from .target_support import context_limit
from .text_deltas import TextDeltas
from .tool_parsers import detect_parser, make_parser
from .traffic_recorder import RECORDER_COUNTERS, TrafficRecorder

MAX_BODY_BYTES = 16 * 1024 * 1024
RESPONSES_PREFIX = "/v1/responses/"  # + a stored response's id (GET, DELETE; GET .../input_items)
FALLBACK_MAX_TOKENS = 4096  # a request without max_tokens, on a target whose config states no context length


class ClientGone(Exception):
    """The client closed a streamed answer's connection: generation is abandoned."""


class CompletionService:
    """What the HTTP layer calls: checks a request, has the serving loop generate it, and shapes the answer.

    Args:
        lm: the `SpeculativeLM` that answers (its tokenizer is used).
        model_name: the id clients address (`model`); requests naming another are refused (404).
        defaults: `generate` options for the fields a request leaves out (max_new_tokens, do_sample, ...). Without
            a max_new_tokens there, a request without `max_tokens` may run to the end of the target's context (as
            OpenAI's and vLLM's; `FALLBACK_MAX_TOKENS` for a target that states no context).
        cache_slots: conversations whose target cache is kept between requests (0: none).
        chat_template: a Jinja template used instead of the tokenizer's.
        api_key: when set, every request must carry `Authorization: Bearer <api_key>` (else 401), as vLLM's
            `--api-key`; /health stays open.
        max_batch: requests generated together at most (continuous batching); 1 answers one at a time.
        processor: a vision-language target's processor (`multimodal.image_processor_for`): chat messages may then
            hold `image_url` parts (base64 data URLs); such requests prefill alone and keep no conversation cache.
        chat_template_kwargs: keywords for the chat template (a request's `chat_template_kwargs` update them).
        tool_parser: how answers' tool calls are read (inference/tool_parsers.py): "auto" (the format the chat template
            shows, when it is one of `tool_parsers.PARSERS`), a parser's name, or None (requests with tools must then
            force the calls: `tool_choice` "required" or a named function).
        reasoning_parser: how chat answers' reasoning is split off (inference/reasoning.py) into `reasoning_content`:
            "auto" (`think` when the chat template knows `</think>`), a parser's name, or None (all content).
        responses_store: `/v1/responses` responses kept for `previous_response_id` and `GET /v1/responses/{id}`
            (inference/response_store.py), the least recently used forgotten past it; 0: none.
        responses_dir: also keep them as files in this folder, across restarts (None: in memory only).
        record: append every answered request to this JSONL file as training data: chat requests as conversations,
            completions as prompt-completion records (inference/traffic_recorder.py; None: nothing is kept).
        batching: None (auto): concurrent requests batched, except on CUDA (one at a time on the fast path, which is
            faster there: inference/serial_engine.py) and for hybrid targets; True: batched; False: one at a time.
    """

    def __init__(self, lm: Any, model_name: str, defaults: dict[str, Any] | None = None, cache_slots: int = 4,
                 chat_template: str | None = None, api_key: str | None = None, max_batch: int = 8,
                 processor: Any = None, chat_template_kwargs: dict[str, Any] | None = None,
                 tool_parser: str | None = "auto", reasoning_parser: str | None = "auto",
                 responses_store: int = 1000, responses_dir: str | None = None, record: str | None = None,
                 batching: bool | None = None) -> None:
        if lm.tokenizer is None:
            raise ValueError("specheads serve needs the SpeculativeLM's tokenizer (SpeculativeLM(..., tokenizer=...))")
        self.lm, self.tokenizer, self.model_name = lm, lm.tokenizer, model_name
        self.defaults = dict(defaults or {})
        self.chat_template, self.processor = chat_template, processor
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # a request's `chat_template_kwargs` update them
        template = chat_template or getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        template = template if isinstance(template, str) else None
        tool_parser = detect_parser(template) if tool_parser == "auto" else tool_parser
        self.tool_parser = None if tool_parser is None else make_parser(tool_parser)
        reasoning_parser = detect_reasoning_parser(template) if reasoning_parser == "auto" else reasoning_parser
        self.reasoning_parser = None if reasoning_parser is None else make_reasoning_parser(reasoning_parser)
        self.loop = ServingLoop(lm, max_batch, PromptCachePool(cache_slots), batching)
        self.api_key = api_key
        self.responses = ResponseStore(responses_store, responses_dir)
        self.recorder = None if record is None else TrafficRecorder(record)
        # JSON schema text / regex / "json_object" -> its constraint (compiling takes seconds; the JSON-object one
        # learns the tokens of each state as it meets them)
        self._constraints: dict[str, Any] = {}

    def warm_up(self) -> None:
        """One short generation, so the first client does not pay for first-call allocations and kernel setup (its
        answer is not one a corpus lookup should learn)."""
        ids = self.tokenizer("Hello", return_tensors="pt").input_ids.to(self.lm.target.device)
        request = self.lm.batch_request(ids, max_new_tokens=4)
        request.learn = False
        self.loop.run(request)

    def close(self) -> None:
        """Stop the serving loop (requests still running fail)."""
        self.loop.close()

    def metrics(self) -> dict[str, Any]:
        """The serving loop's counters (`/metrics`), and the recorder's when the server records its traffic."""
        metrics: dict[str, Any] = self.loop.metrics()
        if self.recorder is not None:
            metrics.update(recorded_answers=self.recorder.recorded, unrecorded_requests=self.recorder.skipped)
        return metrics

    def check_key(self, authorization: str | None) -> None:
        """Refuse (401) a request without the server's API key, when it has one."""
        expected = f"Bearer {self.api_key}".encode()
        if self.api_key is not None and not hmac.compare_digest((authorization or "").encode(), expected):
            raise ApiError("a valid API key is required: send 'Authorization: Bearer <key>'", 401,
                           error_type="authentication_error")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "specheads"}]}

    def parse(self, body: Any, chat: bool) -> ParsedRequest:
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            raise ApiError(f"model {body['model']!r} is not served here; this server serves {self.model_name!r}",
                           status=404, param="model", error_type="not_found_error")
        return parse_request(body, chat, self.tokenizer, self.defaults, self.chat_template, self.processor,
                             self.chat_template_kwargs, self.tool_parser and self.tool_parser.name,
                             self.lm.target.generation_config)

    def complete(
        self, request: ParsedRequest, chat: bool = True, on_text: Any = None
    ) -> tuple[list[Choice], dict[str, Any], dict[str, Any]]:
        """Generate the answer's `request.n` choices: (choices, usage, statistics). Sampled choices are rows of the
        running batch, each with its own generator (seed + index when seeded); greedy ones are one answer, copied.
        `on_text(index, piece, logprobs, reasoning=...)` gets each streamed piece, with the log-probabilities of the
        tokens its text is made of when the request asks for them (else None), on this thread; if it raises, the
        generation is cancelled and the error passes on. Streamed, a choice's `logprobs` then holds the tokens not yet
        sent with a piece (None if none), so that the pieces' and the last chunk's together are the non-streamed
        answer's.
        A chat answer is read into its parts (`answer_parts.AnswerParts`): its think block (`Choice.reasoning`, streamed
        as `on_text(..., reasoning=piece)`) and tool calls (`Choice.tool_calls`, streamed as they are written as
        `on_text(..., tool_calls=[CallDelta, ...])`) split off the content (`text`); streamed, text that may still
        become either is held back, and what was not sent is `Choice.unsent` / `Choice.unsent_reasoning` /
        `Choice.unsent_calls`."""
        sampled = bool(request.options.get("do_sample"))
        runs = request.n if sampled else 1
        pieces: queue.SimpleQueue[tuple[int, str, str, int]] = queue.SimpleQueue()  # run, content, reasoning, covered
        ids = request.input_ids.to(self.lm.target.device)
        options = dict(request.options)
        if options.get("max_new_tokens") is None:
            options["max_new_tokens"] = self._room(ids.shape[1])
        jobs, deltas = [], []
        readers = [self._answer_parts(request, chat) for _ in range(runs)]

        def send(piece: str, run: int) -> None:
            # a piece goes with the count of tokens its text covers (read on the loop thread, as it is sent); read
            # into parts, only what is surely reasoning or content (the rest may still be a block's end or a call)
            reasoning, piece = readers[run].feed(piece)
            calls = readers[run].take_calls()  # tool calls as they are written: names, then argument pieces
            if piece or reasoning or calls or request.logprobs is not None:
                pieces.put((run, piece, reasoning, calls, deltas[run].covered))

        for run in range(runs):
            deltas.append(TextDeltas(self.tokenizer, request.stop,
                                     None if on_text is None else (lambda piece, run=run: send(piece, run))))
            processors = self._processors(request, ids.shape[1])
            seed = None if request.seed is None else request.seed + run
            try:
                jobs.append(self.lm.batch_request(ids, streamer=deltas[-1], logits_processor=processors, seed=seed,
                                                  record_logits=request.logprobs is not None, inputs=request.inputs,
                                                  prediction=request.prediction, **options))
            except ValueError as err:  # the prompt does not fit, a setting the target refuses, ...
                raise ApiError(str(err)) from err
        start = time.perf_counter()
        # only the first run uses the pool: the others would evict other conversations' slots for the same prompt
        # (a conversation about images keeps its slot while its images stay the same: `PromptCache.take`)
        tickets = [self.loop.submit(job, pooled=run == 0) for run, job in enumerate(jobs)]
        streams = [LogprobsStream(job, request.logprobs, self.tokenizer, chat) for job in jobs]
        try:
            while on_text is not None and (not all(t.done for t in tickets) or not pieces.empty()):
                try:  # the loop thread puts; this thread sends
                    run, piece, reasoning, calls, covered = pieces.get(timeout=0.05)
                except queue.Empty:
                    continue
                logprobs = None if request.logprobs is None else streams[run].take(covered)
                for index in range(run, request.n, runs):  # a greedy answer goes to every choice
                    on_text(index, piece, logprobs, reasoning=reasoning or None, tool_calls=calls or None)
            for ticket in tickets:
                ticket.wait()
        except BaseException:
            for job in jobs:
                job.cancelled = True  # the rows leave the batch before the next round
            raise
        seconds = time.perf_counter() - start
        choices, streamed = [], on_text is not None
        for run, (job, delta, stream) in enumerate(zip(jobs, deltas, streams)):
            new = job.new_tokens
            logprobs = None
            if request.logprobs is not None:  # the answer's own tokens (those not streamed yet)
                logprobs = stream.take(answer_tokens(self.tokenizer, new, delta.text), final=not streamed)
            parts = readers[run].finish(delta.text)
            reason = finish_reason(delta.stopped, new, job.max_new_tokens, job.eos, called_tools=bool(parts.calls))
            unsent = (parts.unsent_content, parts.unsent_reasoning, parts.unsent_calls) if streamed else ("", "", [])
            thought = readers[run].reasoning_length(delta.text)
            choices.append(Choice(parts.content, reason, logprobs, parts.calls, unsent[0], parts.reasoning, unsent[1],
                                  unsent[2], tokens_covering(self.tokenizer, new, thought) if thought else 0))
        if self.recorder is not None and chat and request.messages is not None:  # each distinct answer once
            self.recorder.record(request.messages, request.tools.tools if request.tools else None,
                                 [(c.text, c.reasoning, [call.body() for call in c.tool_calls], c.finish_reason)
                                  for c in choices])
        elif self.recorder is not None and not chat:  # /v1/completions: prompt-completion records
            prompt = self.tokenizer.decode(ids[0], skip_special_tokens=True)
            self.recorder.record_completion(prompt, [(c.text, c.finish_reason) for c in choices])
        choices = [choices[index % runs] for index in range(request.n)]
        generated = sum(len(job.new_tokens) for job in jobs)
        completion = sum(len(jobs[index % runs].new_tokens) for index in range(request.n))
        usage = {"prompt_tokens": ids.shape[1], "completion_tokens": completion, "total_tokens": ids.shape[1] + completion,
                 "prompt_tokens_details": {"cached_tokens": jobs[0].reused_prompt_tokens}}
        if chat:  # OpenAI's count of the reasoning among the completion tokens
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
        if request.prediction:  # how much of the prediction the answers kept (summed over the choices, as tokens are)
            counts = [prediction_usage(request.prediction, job.new_tokens) for job in jobs]  # greedy: one, copied
            usage.setdefault("completion_tokens_details", {}).update(
                {key: sum(counts[index % runs][key] for index in range(request.n)) for key in counts[0]})
        forwards = sum(job.target_forwards for job in jobs)
        summary = {"mean_accepted": generated / max(forwards, 1), "target_forwards": forwards,
                   "tokens_per_second": generated / seconds if seconds > 0 else 0.0,
                   "reused_prompt_tokens": jobs[0].reused_prompt_tokens}
        return choices, usage, summary

    def _processors(self, request: ParsedRequest, prompt_length: int) -> list[Any] | None:
        """The request's logits processors, fresh for one run: OpenAI's penalties, its logit biases, then its JSON
        constraint (the one that bans tokens last, so no bias lifts a ban)."""
        processors: list[Any] = []
        if request.presence_penalty or request.frequency_penalty:
            processors.append(OccurrencePenalties(prompt_length, request.presence_penalty, request.frequency_penalty))
        if request.logit_bias:
            processors.append(LogitBias(request.logit_bias))
        if request.json_schema is not None or request.regex is not None or request.json_object:
            processors.append(self._constraint(request))
        return processors or None

    def _answer_parts(self, request: ParsedRequest, chat: bool) -> AnswerParts:
        """A reader of one answer's parts (a completion's, or a chat's without tools or reasoning parser: the text as
        it is)."""
        reasoning = self.reasoning_parser if chat else None
        opened = reasoning is not None and reasoning.opens_in_prompt(self.tokenizer.decode(request.input_ids[0, -8:]))
        return AnswerParts(request.tools, self.tool_parser, reasoning, opened)

    def _room(self, prompt_tokens: int) -> int:
        """New tokens a request without `max_tokens` may take: the rest of the target's context."""
        context, name = context_limit(self.lm.target)
        if context is None:
            return FALLBACK_MAX_TOKENS
        if prompt_tokens >= context:
            raise ApiError(f"the prompt's {prompt_tokens} tokens fill {name} of {context} positions: no room to answer",
                           param="messages")
        return context - prompt_tokens

    def _constraint(self, request: ParsedRequest) -> Any:
        """A fresh constraint for the request's JSON schema, regex or any JSON object, made once per schema / regex
        and kept (a fresh copy shares what it compiled or learned); errors name the field that asked for it
        (`response_format`, `guided_regex`, ...)."""
        from .constraints import CHAT_JSON_WHITESPACE, json_schema_constraint, regex_constraint

        field_name, schema, regex = request.constraint_field, request.json_schema, request.regex
        if regex is not None:
            key, what = "regex:" + regex, "regex"
        elif request.json_object:
            key, what = "json_object", "JSON object"
        else:
            key, what = json.dumps(schema, sort_keys=True), "JSON schema"
        if key not in self._constraints:
            try:
                self._constraints[key] = (
                    regex_constraint(self.tokenizer, regex) if regex is not None
                    else json_object_constraint(self.tokenizer) if request.json_object
                    else json_schema_constraint(self.tokenizer, schema, CHAT_JSON_WHITESPACE))
            except ImportError as err:
                raise ApiError(str(err), status=501, param=field_name) from err
            except Exception as err:  # outlines-core's own errors for what it cannot compile, a tokenizer without EOS
                raise ApiError(f"{field_name}: cannot compile the {what}: {err}", param=field_name) from err
        return self._constraints[key].fresh()


class LogprobsStream:
    """A request's log-probabilities handed out in order, each token's once: with the streamed piece its text is
    in, or at the end."""

    def __init__(self, job: Any, top: int | None, tokenizer: Any, chat: bool) -> None:
        self.job, self.top, self.tokenizer, self.chat = job, top, tokenizer, chat
        self.sent = 0  # tokens whose log-probabilities went out
        self.offset = 0  # completions: where the next token's text starts in the answer

    def take(self, covered: int, final: bool = False) -> dict[str, Any] | None:
        """The `logprobs` object of the tokens after those sent, up to `covered` (None if there are none, unless
        `final`). Only tokens whose logits are recorded: the loop thread records a round's right after emitting it,
        and those not yet recorded go with a later piece."""
        logits = self.job.recorder.logits
        end = covered if final else min(covered, len(logits))
        if end <= self.sent and not final:
            return None
        tokens = self.job.new_tokens[self.sent:end]
        part = token_logprobs(torch.stack(logits[self.sent:end]) if tokens else None, tokens, self.top or 0,
                              self.tokenizer, self.chat, self.offset)
        self.offset += sum(len(piece) for piece in part.get("tokens", []))
        self.sent = max(self.sent, end)
        return part


def prometheus_text(metrics: dict[str, int | dict[str, int]]) -> str:
    """`ServingLoop.metrics` in Prometheus' text format: counters `specheads_<name>_total` (labeled ones one line per
    label value), gauges as they are."""
    lines = []
    for name, value in metrics.items():
        if name in LABELED_COUNTERS:
            label, help_text = LABELED_COUNTERS[name]
            lines += [f"# HELP specheads_{name}_total {help_text}", f"# TYPE specheads_{name}_total counter"]
            lines += [f'specheads_{name}_total{{{label}="{key}"}} {count}' for key, count in value.items()]
        elif name in COUNTERS or name in RECORDER_COUNTERS:
            help_text = COUNTERS.get(name) or RECORDER_COUNTERS[name]
            lines += [f"# HELP specheads_{name}_total {help_text}", f"# TYPE specheads_{name}_total counter",
                      f"specheads_{name}_total {value}"]
        else:
            lines += [f"# TYPE specheads_{name} gauge", f"specheads_{name} {value}"]
    return "\n".join(lines) + "\n"


def server_error(err: Exception) -> ApiError:
    return ApiError(f"generation failed: {type(err).__name__}: {err}", 500, error_type="server_error")


class OpenAIHandler(BaseHTTPRequestHandler):
    """HTTP/1.0 handler: one request per connection; streamed answers end with the connection."""

    service: CompletionService  # set on the subclass `make_server` builds
    quiet = False

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        try:
            if self.path.rstrip("/") == "/health":
                self._send_json(HTTPStatus.OK, {"status": "ok"})
                return
            if self.path.rstrip("/") == "/metrics":  # open like /health, as vLLM's (the API key guards /v1)
                self._send(HTTPStatus.OK, prometheus_text(self.service.metrics()).encode(),
                           "text/plain; version=0.0.4")
                return
            self.service.check_key(self.headers.get("Authorization"))
            path = self.path.rstrip("/")
            if path.startswith(RESPONSES_PREFIX) and path.endswith("/input_items"):
                response_id = path[len(RESPONSES_PREFIX):-len("/input_items")]
                self._send_json(HTTPStatus.OK, self.service.responses.input_items(response_id))
            elif path.startswith(RESPONSES_PREFIX):
                self._send_json(HTTPStatus.OK, self.service.responses.get(path[len(RESPONSES_PREFIX):]))
            elif path == "/v1/models":
                self._send_json(HTTPStatus.OK, self.service.models())
            else:
                raise ApiError(f"no route GET {self.path}", 404)
        except ApiError as err:
            self._send_json(err.status, err.body())

    def do_DELETE(self) -> None:  # noqa: N802
        try:
            self.service.check_key(self.headers.get("Authorization"))
            path = self.path.rstrip("/")
            if not path.startswith(RESPONSES_PREFIX):
                raise ApiError(f"no route DELETE {self.path}; expected {RESPONSES_PREFIX}{{id}}", 404)
            self._send_json(HTTPStatus.OK, self.service.responses.delete(path[len(RESPONSES_PREFIX):]))
        except ApiError as err:
            self._send_json(err.status, err.body())

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.rstrip("/")
        chat = {"/v1/chat/completions": True, "/v1/completions": False, "/v1/responses": True}.get(path)
        try:
            self.service.check_key(self.headers.get("Authorization"))
            if chat is None:
                raise ApiError(f"no route POST {self.path}; expected /v1/chat/completions, /v1/completions or "
                               "/v1/responses", 404)
            if path == "/v1/responses":
                self._respond(self._read_json())
                return
            request = self.service.parse(self._read_json(), chat)
            if request.stream:
                self._stream(request, chat)
                return
            choices, usage, stats = self.service.complete(request, chat)
            self._send_json(HTTPStatus.OK, response_body(chat, self.service.model_name, choices, usage, stats))
        except ApiError as err:
            self._send_json(err.status, err.body())
        except Exception as err:  # a fault of the server's, not the request's: say so, keep serving
            self.log_error("%s: %s", type(err).__name__, err)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, server_error(err).body())

    def _respond(self, body: Any) -> None:
        """POST /v1/responses: the chat request it asks for (after the conversation its `previous_response_id`
        continues), answered as a response object or its events, and stored unless it says `store: false`."""
        continued = self.service.responses.continued(body) if isinstance(body, dict) else body
        request = self.service.parse(chat_body(continued), True)
        body = {**body, "store": self.service.responses.stores(body)}  # as the response object says it
        if request.stream:
            self._stream_response(request, body, continued)
            return
        (choice,), usage, stats = self.service.complete(request, True)
        response = response_object(new_item_id("resp"), int(time.time()), body, self.service.model_name, choice, usage,
                                   stats)
        self.service.responses.keep(continued, response)
        self._send_json(HTTPStatus.OK, response)

    def _stream_response(self, request: ParsedRequest, body: dict[str, Any], continued: dict[str, Any]) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def write(event_type: str, payload: dict[str, Any]) -> None:
            try:
                self.wfile.write(event_bytes(event_type, payload))
                self.wfile.flush()
            except OSError as err:  # the client left: stop generating for it
                raise ClientGone() from err

        events = ResponseEvents(write, body, self.service.model_name)
        try:
            events.created()
            choices, usage, stats = self.service.complete(
                request, True, on_text=lambda index, piece, logprobs, reasoning=None, tool_calls=None: events.piece(
                    piece, reasoning, tool_calls))
            self.service.responses.keep(continued, events.finish(choices[0], usage, stats))
        except ClientGone:
            return
        except Exception as err:  # headers already sent: the error travels as an event
            if not isinstance(err, ApiError):
                self.log_error("%s: %s", type(err).__name__, err)
            error = (err if isinstance(err, ApiError) else server_error(err)).body()["error"]
            self.wfile.write(event_bytes("error", {"type": "error", "sequence_number": events.sequence,
                                                   "code": error["code"], "message": error["message"],
                                                   "param": error["param"]}))

    def _read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            raise ApiError(f"Content-Length {length}: expected a JSON body of 1 to {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(f"the request body is not valid JSON: {err}") from err

    def _stream(self, request: ParsedRequest, chat: bool) -> None:
        request_id, model = new_id(chat), self.service.model_name
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def send(index: int, piece: str | None, logprobs: dict[str, Any] | None = None, reason: str | None = None,
                 first: bool = False, tool_calls: list | None = None, reasoning: str | None = None) -> None:
            try:
                self.wfile.write(sse(chunk_body(chat, request_id, model, piece, reason, first=first, index=index,
                                                logprobs=logprobs, tool_calls=tool_calls, reasoning=reasoning)))
                self.wfile.flush()
            except OSError as err:  # the client left: stop generating for it
                raise ClientGone() from err

        try:
            for index in range(request.n) if chat else []:  # a chat stream opens each choice with the role
                send(index, None, first=True)
            choices, usage, stats = self.service.complete(request, chat, on_text=send)
            for index, choice in enumerate(choices):  # with the log-probabilities no piece carried
                if choice.unsent_reasoning:  # held back while it could have been the block's end
                    send(index, None, reasoning=choice.unsent_reasoning)
                if choice.unsent or choice.unsent_calls:  # content held back while it could have been a call; the
                    send(index, choice.unsent, tool_calls=choice.unsent_calls)  # calls' last pieces
                send(index, None, choice.logprobs, reason=choice.finish_reason)
            if request.include_usage:
                self.wfile.write(sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                                      "model": model, "choices": [], "usage": usage, "specheads": stats}))
            self.wfile.write(sse("[DONE]"))
        except ClientGone:
            return
        except Exception as err:  # headers already sent: the error travels as an event
            if not isinstance(err, ApiError):
                self.log_error("%s: %s", type(err).__name__, err)
            self.wfile.write(sse((err if isinstance(err, ApiError) else server_error(err)).body()))
            self.wfile.write(sse("[DONE]"))

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
        if not self.quiet:
            super().log_message(format, *args)


def make_server(service: CompletionService, host: str = "127.0.0.1", port: int = 8000,
                quiet: bool = False) -> ThreadingHTTPServer:
    """An HTTP server answering with `service` (call `serve_forever()`; port 0 picks a free port)."""
    handler = type("Handler", (OpenAIHandler,), {"service": service, "quiet": quiet})
    return ThreadingHTTPServer((host, port), handler)
