"""Stored responses of `POST /v1/responses`: `previous_response_id` continues a conversation the server holds.

OpenAI's Responses API keeps each response (unless the request says `store: false`), so a client sends only the new
turn and names the response it follows: the new request's input is the previous response's input items, then its
output items (reasoning, message, function calls), then its own input (`instructions` are not carried over, as
OpenAI's). `GET /v1/responses/{id}` returns a stored response, `GET /v1/responses/{id}/input_items` the items it
answered, `DELETE /v1/responses/{id}` forgets it.

Responses live in this process's memory, the least recently used forgotten past `capacity` (`specheads serve
--responses-store N`; 0: none kept, and `previous_response_id` is refused by name). With a `folder` (`specheads serve
--responses-dir DIR`) each stored response is also a JSON file there, written atomically, touched when used and
removed when forgotten or deleted, so a restarted server continues the conversations it held (the newest `capacity`
files are read back; an unreadable one is skipped with a warning). The conversation's prompt is the
earlier one plus the answer, so where the chat template renders the answer as it was written, the server's prompt
cache slots (`--cache-slots`) reuse the target's cache of it, as for a chat client that re-sends the conversation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from specheads.atomic_files import write_atomically

from .openai_errors import ApiError

logger = logging.getLogger(__name__)


def input_items(value: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


class ResponseStore:
    """Finished responses and the input items each answered, by response id; safe to use from several threads (the
    server's handlers). With `folder`, also kept on disk across restarts (see the module docstring)."""

    def __init__(self, capacity: int = 1000, folder: str | os.PathLike | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity={capacity!r}: expected a number of responses >= 0 (0: none stored)")
        self.capacity = capacity
        self._responses: OrderedDict[str, tuple[dict[str, Any], list[Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._read_folder()

    def _file(self, response_id: str) -> Path:
        """The response's file: named by a hash of its id (any id makes a safe, fixed-length file name)."""
        return self.folder / f"{hashlib.sha256(response_id.encode()).hexdigest()[:32]}.json"

    def _read_folder(self) -> None:
        """Load the folder's responses, least recently used first; those past `capacity` are removed."""
        files = sorted(self.folder.glob("*.json"), key=lambda path: (path.stat().st_mtime_ns, path.name))
        for path in files:
            try:
                record = json.loads(path.read_text())
                response, items = record["response"], record["input"]
                self._responses[str(response["id"])] = (response, list(items))
            except (OSError, ValueError, KeyError, TypeError) as err:
                logger.warning("responses folder %s: skipping unreadable %s (%s)", self.folder, path.name, err)
        while len(self._responses) > self.capacity:
            self._forget(next(iter(self._responses)))

    def _forget(self, response_id: str) -> None:
        """Drop a response from memory and disk (lock held or not yet shared)."""
        self._responses.pop(response_id, None)
        if self.folder is not None:
            self._file(response_id).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._responses)

    def continued(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request `body` with the conversation it continues put before its input (`previous_response_id` read
        and removed); the body itself when it names none. An unknown id is an `ApiError` naming it."""
        previous = body.get("previous_response_id")
        if previous is None:
            return body
        if self.capacity == 0:
            raise ApiError("previous_response_id: responses are not stored by this server (--responses-store 0): send "
                           "the whole conversation as input", param="previous_response_id")
        if not isinstance(previous, str):
            raise ApiError(f"previous_response_id={previous!r}: expected a response id", param="previous_response_id")
        response, items = self._take(previous, "previous_response_id")
        history = items + [_as_input(item) for item in response["output"]]
        rest = {key: value for key, value in body.items() if key != "previous_response_id"}
        return {**rest, "input": history + input_items(body.get("input"))}

    def stores(self, body: dict[str, Any]) -> bool:
        """Whether the response to `body` will be stored (the response object's `store`)."""
        return self.capacity > 0 and body.get("store") is not False

    def keep(self, body: dict[str, Any], response: dict[str, Any]) -> None:
        """Store a finished `response` to the (continued) request `body`, unless it asked `store: false`."""
        if not self.stores(body):
            return
        with self._lock:
            stored = (copy.deepcopy(response), input_items(body.get("input")))
            self._responses[response["id"]] = stored
            self._responses.move_to_end(response["id"])
            if self.folder is not None:
                write_atomically(self._file(response["id"]), json.dumps({"response": stored[0], "input": stored[1]}))
            while len(self._responses) > self.capacity:
                self._forget(next(iter(self._responses)))

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response (an `ApiError` 404 when it is not stored)."""
        return copy.deepcopy(self._take(response_id)[0])

    def input_items(self, response_id: str) -> dict[str, Any]:
        """The input items a stored response answered, as OpenAI's list object."""
        items = copy.deepcopy(self._take(response_id)[1])
        return {"object": "list", "data": items, "has_more": False}

    def delete(self, response_id: str) -> dict[str, Any]:
        with self._lock:
            if response_id not in self._responses:
                raise _not_found(response_id)
            self._forget(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _take(self, response_id: str, param: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        with self._lock:
            if response_id not in self._responses:
                raise _not_found(response_id, param)
            self._responses.move_to_end(response_id)
            if self.folder is not None:  # its file's time is its recency after a restart
                try:
                    os.utime(self._file(response_id))
                except FileNotFoundError:  # removed by hand: it stays in memory until forgotten
                    pass
            return self._responses[response_id]


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(f"no stored response {response_id!r} (never stored, store: false, deleted, or forgotten past this "
                    "server's --responses-store)", 404 if param is None else 400, param=param)


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that gives it back to the model (a message's role and text parts, a call's
    call_id / name / arguments, reasoning's text)."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    if item["type"] == "function_call":
        return {key: item[key] for key in ("type", "call_id", "name", "arguments")}
    return {key: item[key] for key in ("type", "summary", "content") if key in item}
