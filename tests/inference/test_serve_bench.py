"""`specheads bench-serve` against a live server: every prompt answered at each concurrency level (the answers the
server gives alone), timings that fit together, tokens from the servers' usage, failed requests counted; a server
that is not there is a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.cli import main
from specheads.inference.serve_bench import percentiles

from .test_server import TEMPLATE, server  # noqa: F401 (server is a fixture)

PROMPTS = ["Tom had a dog", "The sun was", "Lily went to the park", "Once upon a time"]


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([])["p50"] is None


def test_bench_serve_measures_every_request_at_each_level(server, tmp_path, capsys):  # noqa: F811
    url, _, target, tokenizer = server
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--url", url + "/v1", "--prompts", str(prompts), "--max-tokens", "12",
                 "--concurrency", "1,3", "--out", str(out), "--no-progress"])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["model"] == "stories" and [level["concurrency"] for level in results["levels"]] == [1, 3]
    expected = []
    for prompt in PROMPTS:  # the chat answer the server gives each prompt alone: greedy, through its template
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            chat_template=TEMPLATE, return_tensors="pt", return_dict=True)["input_ids"]
        new = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        expected.append((tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True), new.shape[1] - ids.shape[1]))
    for level in results["levels"]:
        assert level["requests"] == len(PROMPTS) and level["errors"] == []
        assert [(r["text"], r["output_tokens"]) for r in level["per_request"]] == expected
        assert level["output_tokens"] == sum(tokens for _, tokens in expected)
        for request in level["per_request"]:
            assert 0 < request["ttft"] <= request["latency"] and request["tau"] >= 1
        assert level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"] and level["latency_s"]["p90"] <= level["seconds"]
        assert level["output_tokens_per_second"] == pytest.approx(level["output_tokens"] / level["seconds"])
    assert "| 3 | 4 | 0 |" in capsys.readouterr().out  # the markdown table's row of level 3


def test_bench_serve_counts_failed_requests_and_refuses_an_absent_server(server, tmp_path, capsys):  # noqa: F811
    url = server[0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tom had a dog\nThe sun was\n")
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--url", url + "/v1", "--prompts", str(prompts), "--model", "no-such-model",
                 "--max-tokens", "4", "--out", str(out), "--no-progress"])
    level = json.loads(out.read_text())["levels"][0]
    assert code == 1 and level["requests"] == 0 and len(level["errors"]) == 2 and "404" in level["errors"][0]
    code = main(["bench-serve", "--url", "http://127.0.0.1:9/v1", "--prompts", str(prompts), "--no-progress"])
    assert code == 2 and "cannot list the server's models" in capsys.readouterr().err
    assert main(["bench-serve", "--url", url, "--prompts", str(prompts), "--concurrency", "0"]) == 2
