"""One request at a time (inference/serial_engine.py) for an attention target: what the server and `generate --prompts`
use on CUDA, where each request runs on the fast path (a batched round runs eagerly there, 15x a fast-path round).
On the CPU the fast path runs eagerly when forced (`fast_path=True`): that is how its rows are tested here."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specheads import SpeculativeLM
from specheads.inference.batch_file import generate_file
from specheads.inference.batched import BatchEngine
from specheads.inference.fast_path import FastPathRunner
from specheads.inference.prompts import Prompt
from specheads.inference.serial_engine import SerialEngine, engine_for
from specheads.inference.serving_loop import ServingLoop

from .conftest import hf_greedy, make_heads

PROMPTS = ["Once upon a time", "The little dog ran far", "Lily saw a bird"]


def test_engine_for_batches_on_the_cpu_and_answers_one_at_a_time_on_cuda(stories260k, tiny_target_factory):
    target = stories260k[0]
    lm = SpeculativeLM(target, make_heads(target, "eagle3"))
    assert isinstance(engine_for(lm), BatchEngine)
    assert isinstance(engine_for(lm, True), BatchEngine)
    assert isinstance(engine_for(lm, False, isolate_errors=True), SerialEngine)
    on_cuda = SimpleNamespace(verifies_chains=False, target=SimpleNamespace(device=torch.device("cuda")))
    assert isinstance(engine_for(on_cuda), SerialEngine)  # the decision only: nothing runs
    with pytest.raises(ValueError, match="batching='yes': expected None"):
        engine_for(lm, "yes")
    hybrid = tiny_target_factory("qwen3_5_text")
    hybrid_lm = SpeculativeLM(hybrid, make_heads(hybrid, "eagle3"))
    assert isinstance(engine_for(hybrid_lm), SerialEngine)
    with pytest.raises(ValueError, match=r"verifies each round's root-to-leaf paths.*one at a time"):
        engine_for(hybrid_lm, True)


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_requests_run_whole_on_the_fast_path_one_after_another(head_type, stories260k):
    """Each request answered on the fast path's runner (kept across requests), exactly the target's greedy output,
    streamed; a request with a prediction runs on the eager path (the fast path refuses predictions)."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, head_type))
    engine = SerialEngine(lm, fast_path=True)
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]

    class Collect:
        def __init__(self) -> None:
            self.parts: list[list[int]] = []

        def put(self, tokens: torch.Tensor) -> None:
            self.parts.append(tokens.tolist())

        def end(self) -> None:
            pass

    streamers = [Collect() for _ in prompts]
    requests = [lm.batch_request(ids, max_new_tokens=24, eos_token_id=[], streamer=s) for ids, s in zip(prompts, streamers)]
    predicted = lm.batch_request(prompts[0], max_new_tokens=24, eos_token_id=[], prediction=[5, 6, 7])
    assert engine.add([*requests, predicted]) == [] and engine.occupied == 4
    ended = []
    while engine.occupied:
        ended += engine.step()
    assert ended == [*requests, predicted]
    runner = lm._fast_runner
    assert isinstance(runner, FastPathRunner) and runner.verifiers  # the rows verified on the fast path
    for request, ids, streamer in zip([*requests, predicted], [*prompts, prompts[0]], [*streamers, None]):
        assert request.new_tokens == hf_greedy(target, ids, 24)[0, ids.shape[1]:].tolist()
        if streamer is not None:
            assert streamer.parts[0] == ids[0].tolist() and sum(streamer.parts[1:], []) == request.new_tokens
    assert engine.stats["new_tokens"] == 96 and engine.stats["batched_forwards"] == engine.stats["target_forwards"]


def test_the_serving_loop_and_a_prompts_file_without_batching(tmp_path, stories260k):
    """`ServingLoop(batching=False)` (serve --batching off) and `generate_file(batching=False)` (generate --prompts
    --batching off) answer one request at a time, with the same answers as batched decoding."""
    target, tokenizer = stories260k
    lm = SpeculativeLM(target, make_heads(target, "eagle3"), tokenizer=tokenizer)
    loop = ServingLoop(lm, max_batch=4, batching=False)
    assert isinstance(loop.engine, SerialEngine)
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    request = loop.run(lm.batch_request(ids, max_new_tokens=16, eos_token_id=[]))
    assert request.new_tokens == hf_greedy(target, ids, 16)[0, ids.shape[1]:].tolist()
    assert loop.metrics()["requests_finished"] == 1
    loop.close()
    prompts = [Prompt(prompt_id=str(i), category="story", text=text, input_ids=tokenizer(text, return_tensors="pt").input_ids)
               for i, text in enumerate(PROMPTS)]
    answers = {}
    for batching in (None, False):
        out = tmp_path / f"answers_{batching}.jsonl"
        summary = generate_file(lm, prompts, out, max_batch=3, max_new_tokens=12, show_progress=False, batching=batching)
        assert summary["answered"] == 3
        answers[batching] = {r["id"]: r["answer"] for r in map(json.loads, out.read_text().splitlines())}
    assert answers[None] == answers[False]


def test_serve_batching_off_builds_a_one_at_a_time_server(stories260k_eagle_dir, capfd):
    """`specheads serve --batching off`: the service's loop answers one request at a time, and says so at start."""
    import argparse

    from specheads.cli import _add_serve, build_server

    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers(dest="command"))
    for batching, serial in (("off", True), ("auto", False)):
        args = parser.parse_args(["serve", "--heads", str(stories260k_eagle_dir), "--port", "0", "--quiet",
                                  "--batching", batching])
        server = build_server(args)
        try:
            assert isinstance(server.RequestHandlerClass.service.loop.engine, SerialEngine) is serial
        finally:
            server.server_close()
            server.RequestHandlerClass.service.close()
        said = capfd.readouterr().err
        assert ("requests one at a time" in said) is serial and ("batches of up to 8" in said) is not serial


def test_the_gpu_checks_conversation_section_passes_on_the_cpu():
    """scripts/gpu_fast_path_check.py's conversation section (what the next GPU call checks) run eagerly here:
    conversations taking turns restore their kept copies, and queued requests equal `generate`."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "gpu_fast_path_check.py"
    spec = importlib.util.spec_from_file_location("gpu_fast_path_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    result = check.conversation_section("cpu", max_new_tokens=12)
    assert result["identical"] and result["reused_every_later_turn"] and len(result["turns"]) == 6
    assert result["serial_requests_identical"] == [True, True, True]
    assert result["round_graph_captured"] is False and result["prompt_graphs_captured"] == []  # no graphs on a CPU
