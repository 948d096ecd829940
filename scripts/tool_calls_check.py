"""Tool calls through `specheads serve` on a real chat model, by hand: each `tool_choice` once, and what came back.

Starts the OpenAI server in this process over a target and heads, with the target's chat template preceded by a
system turn that lists the tools and asks for Hermes' `<tool_call>` format (SmolLM2's own template shows no tools),
and sends one weather question with `tool_choice` auto, required and named; prints each answer's message, its
finish_reason, tau and seconds. Each is then sent again streamed: when the call's first piece (its name) and its last
piece arrived, how many pieces its arguments came in, and whether they join to the unstreamed answer's call.

    python scripts/tool_calls_check.py --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

import torch

from specheads import SpeculativeLM
from specheads.inference.server import CompletionService, make_server

TOOLS_TURN = ("{% if tools %}<|im_start|>system\nYou can call these functions. Answer with <tool_call>{\"name\": ..., "
              "\"arguments\": {...}}</tool_call>.\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today, in celsius?"}]


def streamed_calls(url: str, body: dict, calls: list | None) -> dict:
    """Send `body` streamed: seconds to the first call piece, to its last piece and to the end, the pieces, and
    whether the joined calls are the unstreamed answer's `calls` (names and arguments)."""
    request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    start, times, joined = time.perf_counter(), [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for piece in choice["delta"].get("tool_calls", []):
                    times.append(time.perf_counter() - start)
                    call = joined.setdefault(piece["index"], {"name": piece["function"].get("name"), "arguments": ""})
                    call["arguments"] += piece["function"]["arguments"]
    seconds = time.perf_counter() - start
    same = [c["function"] for c in calls or []] == [joined[i] for i in sorted(joined)]
    return {"pieces": len(times), "first_piece_s": round(times[0], 2) if times else None,
            "last_piece_s": round(times[-1], 2) if times else None, "seconds": round(seconds, 2),
            "joined_equals_unstreamed": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads)
    service = CompletionService(lm, "model", {"max_new_tokens": args.max_new_tokens},
                                chat_template=TOOLS_TURN + lm.tokenizer.chat_template)
    httpd = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": choice, "temperature": 0}
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        print(json.dumps({"tool_choice": choice, "seconds": round(time.perf_counter() - start, 1),
                          "tau": round(answer["specheads"]["mean_accepted"], 2),
                          "finish_reason": answer["choices"][0]["finish_reason"],
                          "message": answer["choices"][0]["message"]}))
        print(json.dumps({"streamed": streamed_calls(url, body, answer["choices"][0]["message"].get("tool_calls"))}))
    httpd.shutdown()
    service.close()


if __name__ == "__main__":
    main()
