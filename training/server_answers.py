"""`specheads data regenerate --server URL`: an OpenAI-compatible server writes the target's answers.

Heads and draft models learn best from the target's own answers (`specheads data regenerate`), but a large target
answering tens of thousands of prompts through transformers' `generate` takes days; a serving engine (vLLM, SGLang,
TGI, `specheads serve`) running the same model answers them in hours, as SpecForge's data regeneration does. Here the
prompts are the same as in-process regeneration's (each conversation's system turns and first user turn(s), benchmark
prompts excluded, `--limit`), sent to `POST {server}/chat/completions` by `--concurrency` client threads; the server
applies the chat template (`chat_template_kwargs` and `tools` go with each request). Each answer is written as it
comes, in the prompts' order, with its `reasoning_content` and `tool_calls` when the server splits them off, so the
file trains as in-process regeneration's does. A resumed run skips the ids already written; each request carries a
seed (`--seed` and its place in the input) for servers that honour one.

Records with images are refused (answer them in-process with a vision-language target, which reads the images).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specheads.training.data import read_records
from specheads.training.image_records import has_images
from specheads.training.preflight import check_writable_file

RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # worth another try: overloaded, restarting, timed out


def server_jobs(input_path: str | Path, limit: int | None = None, exclude: set[str] | None = None,
                ) -> list[dict[str, Any]]:
    """The prompts of `input_path`'s conversations: [{"id", "messages", "tools"?}] (the turns `prompt_turns` keeps)."""
    from specheads.training.data_cli import record_prompt  # data_cli imports this module

    jobs: list[dict[str, Any]] = []
    for n, record in enumerate(read_records(input_path)):
        if limit is not None and len(jobs) >= limit:
            break
        if has_images(record):
            raise ValueError(f"{input_path}, record {n}: holds images, which --server regeneration does not send; "
                             "answer image records in-process (specheads data regenerate --target YOUR_VLM)")
        prompted = record_prompt(record, input_path, exclude)
        if prompted is None:
            continue
        _, messages, keep = prompted
        job = {"id": str(record.get("id", n)), "messages": [messages[i] for i in keep]}
        if record.get("tools"):
            job["tools"] = record["tools"]
        jobs.append(job)
    return jobs


class ServerClient:
    """POSTs chat completions to an OpenAI-compatible server, retrying what is worth retrying.

    Args:
        base_url: the API root, e.g. http://localhost:8000/v1 (a URL without /v1 gets it).
        api_key: sent as a bearer token when given.
        timeout: seconds one request may take.
        retries: further tries after a failed request that may pass later (connection refused, 429, 5xx), waiting
            1, 2, 4, ... seconds between them.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, retries: int = 3) -> None:
        base_url = base_url.rstrip("/")
        self.base_url = base_url if base_url.endswith("/v1") else f"{base_url}/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout, self.retries = timeout, retries

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(url, data=data, headers=self.headers)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:500]
                if err.code not in RETRY_STATUS or attempt == self.retries:
                    raise RuntimeError(f"{url} answered HTTP {err.code}: {detail}") from err
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                if attempt == self.retries:
                    raise RuntimeError(f"{url} could not be reached after {self.retries + 1} tries: {err}") from err
            time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def model_name(self) -> str:
        """The one model the server serves (GET /models); an error lists them when there are several."""
        try:
            listed = [m.get("id") for m in self._request("/models").get("data", [])]
        except RuntimeError as err:
            raise RuntimeError(f"{err}\n(asked which model it serves: name it with --model)") from err
        if len(listed) != 1:
            raise ValueError(f"{self.base_url} serves {listed or 'no models'}: name the one to ask with --model")
        return str(listed[0])

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The assistant message of one chat completion: content, and reasoning_content / tool_calls when given."""
        reply = self._request("/chat/completions", body)
        try:
            message = reply["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as err:
            raise RuntimeError(f"{self.base_url}/chat/completions returned no choices[0].message: "
                               f"{json.dumps(reply)[:300]}") from err
        answer: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        reasoning = message.get("reasoning_content") or message.get("reasoning")  # vLLM / SGLang name it either way
        if reasoning:
            answer["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            answer["tool_calls"] = message["tool_calls"]
        return answer


def regenerate_with_server(
    client: ServerClient,
    output: str | Path,
    input_path: str | Path,
    model: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    concurrency: int = 8,
    limit: int | None = None,
    exclude: set[str] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    show_progress: bool = True,
    answers_per_prompt: int = 1,
) -> int:
    """Have the server answer `input_path`'s prompts and append the conversations to `output` (JSONL, the OpenAI
    messages format with `id`, and `tools` when the record had them); returns the number of records written.
    `answers_per_prompt`: sampled answers of each prompt (`data_cli.answer_copies`), each a request with its own seed.

    Raises:
        ValueError: bad arguments, records without conversations or with images, several models and no `model`.
        RuntimeError: a request failed for good (the message names the record and the server's answer); the records
            written before it stay, and the same command goes on from there.
    """
    # data_cli imports this module: imported here
    from specheads.training.data_cli import answer_copies, done_ids, drop_torn_line

    if concurrency < 1 or max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"--concurrency {concurrency}, --max-new-tokens {max_new_tokens}, --temperature {temperature}: "
                         "expected positive numbers and a temperature >= 0")
    if limit is not None and limit < 1:
        raise ValueError(f"regenerate --limit {limit}: expected a positive number of conversations")
    output = check_writable_file(output, "regenerate output")
    drop_torn_line(output)
    skip = done_ids(output)
    jobs = answer_copies(server_jobs(input_path, limit, exclude), answers_per_prompt, temperature)  # each copy: its own seed
    todo = [(number, job) for number, job in enumerate(jobs) if job["id"] not in skip]
    model = model or client.model_name()

    def ask(item: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        number, job = item
        body: dict[str, Any] = {"model": model, "messages": job["messages"], "max_tokens": max_new_tokens,
                                "temperature": temperature, "top_p": 1.0, "seed": seed * 1_000_003 + number}
        if "tools" in job:
            body["tools"] = job["tools"]
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        try:
            answer = client.answer(body)
        except RuntimeError as err:
            raise RuntimeError(f"record {job['id']!r}: {err}") from err
        return {"id": job["id"], **({"tools": job["tools"]} if "tools" in job else {}),
                "messages": job["messages"] + [answer]}

    written = 0
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc=f"regenerate via {client.base_url}", unit="seq",
               disable=not show_progress)
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        with output.open("a") as f:
            for record in pool.map(ask, todo):  # answers come back in the prompts' order
                f.write(json.dumps(record) + "\n")
                f.flush()
                written += 1
                bar.update(1)
    finally:  # a failed request (or Ctrl-C) ends the run: the requests not yet sent are dropped, not made
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return written
