"""`specheads bench-serve`: load-test any OpenAI-compatible server (ours, vLLM's, SGLang's) the way its users feel it.

    specheads bench-serve --url http://127.0.0.1:8000/v1 --prompts configs/prompts/mt_bench_questions.jsonl \
        --max-tokens 128 --concurrency 1,4 --out serve_bench.json

For each concurrency level C, C client threads send the prompts (chat completions, streamed, greedy unless
`--temperature`), each taking the next prompt as soon as its previous answer ended, as chat users of a server do.
Per request it times the first streamed token (TTFT), the gaps between streamed pieces (ITL), the whole answer, and
reads the output tokens from the final `usage` chunk (and tau from `specheads` statistics, when the server is ours).
Per level: request and output-token throughput over the level's wall time, and mean / p50 / p90 / p99 of TTFT,
TPOT (time per output token after the first) and latency, as vLLM's serving benchmark reports them, so the numbers
compare across servers. JSON out (written atomically) and a markdown table; a failed request is counted and its
error kept, never retried.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from tqdm.auto import tqdm

from specheads.atomic_files import write_atomically
from specheads.inference.prompts import read_prompts


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 of `values` (None each when empty), nearest-rank."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def rank(p: float) -> float:  # the smallest value with at least p% of the values at or below it
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return {"mean": statistics.fmean(values), "p50": rank(50), "p90": rank(90), "p99": rank(99)}


def timed_request(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> dict[str, Any]:
    """Send one streamed chat request; its timings (seconds), output tokens, text and the server's statistics."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    start = time.perf_counter()
    arrivals: list[float] = []  # when each piece of text (content or reasoning) arrived
    text, usage, stats = "", None, None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:  # server-sent events, one `data: ...` line each
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"].get("message", str(event["error"])))
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece or delta.get("tool_calls"):
                    arrivals.append(time.perf_counter())
                    text += piece
            usage = event.get("usage") or usage
            stats = event.get("specheads") or stats
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else None
    ttft = arrivals[0] - start if arrivals else None
    return {"latency": end - start, "ttft": ttft, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tpot": (end - start - ttft) / (tokens - 1) if ttft is not None and tokens and tokens > 1 else None,
            "output_tokens": tokens, "text": text, "tau": stats.get("mean_accepted") if stats else None}


def run_level(url: str, prompts: list[str], concurrency: int, body: dict[str, Any], api_key: str | None,
              timeout: float, show_progress: bool = True) -> dict[str, Any]:
    """All prompts through `concurrency` client threads: the level's summary and its requests."""
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    next_prompt = iter(range(len(prompts)))
    lock = threading.Lock()
    bar = tqdm(total=len(prompts), desc=f"bench-serve c={concurrency}", unit="req", disable=not show_progress)

    def client() -> None:
        while True:
            with lock:
                index = next(next_prompt, None)
            if index is None:
                return
            request = {**body, "messages": [{"role": "user", "content": prompts[index]}]}
            try:
                results[index] = timed_request(url, request, api_key, timeout)
            except (OSError, ValueError, RuntimeError) as err:  # refused, unreachable, malformed: counted, kept
                detail = err.read().decode(errors="replace")[:300] if isinstance(err, urllib.error.HTTPError) else ""
                results[index] = {"error": f"{type(err).__name__}: {err} {detail}".strip()}
            with lock:
                bar.update(1)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    bar.close()
    done = [r for r in results if r is not None and "error" not in r]
    tokens = sum(r["output_tokens"] or 0 for r in done)
    taus = [r["tau"] for r in done if r["tau"] is not None]
    ms = 1000.0
    return {
        "concurrency": concurrency, "requests": len(done), "errors": [r["error"] for r in results if r and "error" in r],
        "seconds": seconds, "request_throughput": len(done) / seconds, "output_tokens": tokens,
        "output_tokens_per_second": tokens / seconds,
        "ttft_ms": {k: v and v * ms for k, v in percentiles([r["ttft"] for r in done if r["ttft"] is not None]).items()},
        "tpot_ms": {k: v and v * ms for k, v in percentiles([r["tpot"] for r in done if r["tpot"] is not None]).items()},
        "itl_ms": {k: v and v * ms for k, v in percentiles([g for r in done for g in r["itl"]]).items()},
        "latency_s": percentiles([r["latency"] for r in done]),
        "mean_tau": statistics.fmean(taus) if taus else None,
        "per_request": results,
    }


def markdown_table(levels: list[dict[str, Any]]) -> str:
    def fmt(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = ["| concurrency | requests | errors | req/s | output tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | "
            "latency p50 / p90 s | tau |", "|---|---|---|---|---|---|---|---|---|"]
    for level in levels:
        rows.append(
            f"| {level['concurrency']} | {level['requests']} | {len(level['errors'])} | {fmt(level['request_throughput'], 2)}"
            f" | {fmt(level['output_tokens_per_second'])} | {fmt(level['ttft_ms']['p50'], 0)} / "
            f"{fmt(level['ttft_ms']['p90'], 0)} | {fmt(level['tpot_ms']['p50'])} / {fmt(level['tpot_ms']['p90'])} | "
            f"{fmt(level['latency_s']['p50'], 2)} / {fmt(level['latency_s']['p90'], 2)} | {fmt(level['mean_tau'], 2)} |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specheads bench-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--prompts", required=True, help="MT-bench-style JSONL (first turns) or plain text lines")
    p.add_argument("--category", action="append", default=None, help="only these categories (repeat)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--model", default=None, help="the model name sent (default: the server's first /v1/models entry)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    p.add_argument("--concurrency", default="1", help="client threads, comma-separated levels (default: 1)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: 600)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def server_model(base_url: str, api_key: str | None, timeout: float) -> str:
    """The first model a server lists (`GET /v1/models`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url + "/models", headers=headers),
                                    timeout=timeout) as response:
            return json.loads(response.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"--url {base_url}: cannot list the server's models ({type(err).__name__}: {err}); is it "
                         "running, and is the URL its /v1 base?") from err


def bench_serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {args.concurrency!r}: expected positive integers, comma-separated")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: expected a positive number")
    base = args.url.rstrip("/")
    prompts = [p["text"] for p in read_prompts(args.prompts, args.category, args.limit)]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompts (after --category / --limit)")
    model = args.model or server_model(base, args.api_key, min(args.timeout, 30))
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    results = {"url": base, "model": model, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "temperature": args.temperature, "levels": []}
    for concurrency in levels:
        results["levels"].append(run_level(base + "/chat/completions", prompts, concurrency, body, args.api_key,
                                           args.timeout, show_progress=not args.no_progress))
    print(f"Server {base} (model {model!r}), {len(prompts)} prompts, max_tokens={args.max_tokens}, "
          f"temperature={args.temperature}\n")
    print(markdown_table(results["levels"]))
    if args.out:
        write_atomically(args.out, json.dumps(results, indent=2))
        print(f"\n[specheads bench-serve] results: {args.out}")
    return 1 if any(level["errors"] for level in results["levels"]) else 0
