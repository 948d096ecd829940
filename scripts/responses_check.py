"""The Responses API against chat completions on a real chat model, by hand: the same answers, and what they cost.

Starts the OpenAI server in this process over a target and heads and sends each of the first `--prompts` MT-bench
first turns three times, greedy: to `/v1/chat/completions`, to `/v1/responses`, and to `/v1/responses` streamed;
then one JSON-mode request (`text.format` json_object). Checks that the three texts agree and prints, per prompt, the
tau of each and whether the streamed deltas joined to the answer, then a summary line.

    python scripts/responses_check.py --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3 \
        --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import urllib.request

import torch

from specheads import SpeculativeLM
from specheads.inference.server import CompletionService, make_server


def post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return response.read()


def streamed_text(url: str, body: dict) -> tuple[str, dict]:
    """(the joined output_text deltas, the final response) of a streamed response."""
    text, final = "", {}
    for block in post(url, {**body, "stream": True}).decode().split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        payload = json.loads(data[len("data: "):])
        if kind == "event: response.output_text.delta":
            text += payload["delta"]
        if kind in ("event: response.completed", "event: response.incomplete"):
            final = payload["response"]
    return text, final


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3")
    parser.add_argument("--questions", default="configs/prompts/mt_bench_questions.jsonl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads)
    service = CompletionService(lm, "model", {"max_new_tokens": args.max_new_tokens})
    service.warm_up()
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    with open(args.questions) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()][: args.prompts]
    taus: dict[str, list[float]] = {"chat": [], "responses": [], "streamed": []}
    agree = 0
    for question in questions:
        chat = json.loads(post(base + "/chat/completions", {"messages": [{"role": "user", "content": question}],
                                                             "temperature": 0, "max_tokens": args.max_new_tokens}))
        request = {"input": question, "temperature": 0, "max_output_tokens": args.max_new_tokens}
        whole = json.loads(post(base + "/responses", request))
        deltas, streamed = streamed_text(base + "/responses", request)
        same = chat["choices"][0]["message"]["content"] == output_text(whole) == output_text(streamed) == deltas
        agree += same
        for name, answer in (("chat", chat), ("responses", whole), ("streamed", streamed)):
            taus[name].append(answer["specheads"]["mean_accepted"])
        print(json.dumps({"prompt": question[:50], "identical": same, "status": whole["status"],
                          "output_tokens": whole["usage"]["output_tokens"],
                          "tau": {name: round(values[-1], 2) for name, values in taus.items()}}), flush=True)
    json_mode = json.loads(post(base + "/responses", {
        "input": "Describe the movie Titanic as a JSON object with the keys title and year.", "temperature": 0,
        "max_output_tokens": args.max_new_tokens, "text": {"format": {"type": "json_object"}}}))
    text = output_text(json_mode)
    try:
        parsed = isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        parsed = False
    print(json.dumps({"json_mode": text, "status": json_mode["status"], "parses_as_object": parsed,
                      "tau": round(json_mode["specheads"]["mean_accepted"], 2)}))
    print(json.dumps({"prompts": len(questions), "identical": agree,
                      "median_tau": {name: round(statistics.median(values), 2) for name, values in taus.items()}}))
    httpd.shutdown()
    service.close()


if __name__ == "__main__":
    main()
