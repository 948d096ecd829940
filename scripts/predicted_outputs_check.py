"""OpenAI's Predicted Outputs through `specheads serve` on a real chat model, by hand: three editing requests, each
answered without and with a `prediction` (the text the edit should mostly keep), alternating, the second round
reported: completion tokens, target forwards, tokens/s, the usage's prediction counts, and whether the answers match.

    python scripts/predicted_outputs_check.py --target smollm2-135m-instruct --heads checkpoints/smollm2-135m-instruct-eagle3
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

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--target", default="smollm2-135m-instruct")
parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-eagle3")
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
lm = SpeculativeLM.from_pretrained(target=args.target, heads=args.heads)
lm.use_cpu_kernels()
service = CompletionService(lm, "m", {"max_new_tokens": 128})
httpd = make_server(service, "127.0.0.1", 0, quiet=True)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"


def post(body: dict) -> tuple[dict, float]:
    r = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(r, timeout=600) as resp:
        out = json.loads(resp.read())
    return out, time.perf_counter() - t


code = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
tasks = [
    ("Rename the function total_price to order_total in this Python code and return the whole code:\n" + code,
     code.replace("total_price", "order_total")),
    ("Fix the typos in this text and return it: The quick brown fox jumpd over the lazy dog. It was a sunny day and "
     "the fox was very hapy.", "The quick brown fox jumped over the lazy dog. It was a sunny day and the fox was very "
     "happy."),
    ("Add a docstring to this function and return the whole code:\n" + code, code),
]
for prompt, prediction in tasks:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 128}
    rows = []
    for rep in range(2):
        for with_pred in (False, True):
            b = dict(body, **({"prediction": {"type": "content", "content": prediction}} if with_pred else {}))
            out, secs = post(b)
            if rep == 1:
                rows.append((with_pred, out["usage"]["completion_tokens"], out["specheads"]["target_forwards"],
                             round(out["usage"]["completion_tokens"] / secs, 1),
                             out["usage"].get("completion_tokens_details"), out["choices"][0]["message"]["content"]))
    print(json.dumps({"task": prompt[:40], "plain": rows[0][:4], "predicted": rows[1][:4], "details": rows[1][4],
                      "same_answer": rows[0][5] == rows[1][5]}))
httpd.shutdown()
service.close()
