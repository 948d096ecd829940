"""Streaming with transformers' streamers: the streamed text is the decoded output, chunk by chunk."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

from specheads import SpeculativeLM, create_heads


class RecordingStreamer:
    """Records every `put` and `end` call (the streamer protocol transformers' generate follows)."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.fixture(scope="module")
def prompt(stories260k):
    return stories260k[1]("Once upon a time", return_tensors="pt").input_ids


def make_lm(target, head_type: str = "eagle") -> SpeculativeLM:
    torch.manual_seed(0)
    options = dict(tree_depth=4, tree_top_k=3, tree_num_nodes=10) if head_type == "eagle" else {}
    return SpeculativeLM(target, create_heads(target, head_type, **options))


def oracle(target, prompt, greedy_reference, oracle_drafter, n: int) -> SpeculativeLM:
    """EAGLE-free speculative model whose drafts are mostly right: accepted chunks of several tokens."""
    lm = make_lm(target, "medusa")
    reference = prompt[0].tolist() + greedy_reference(target, prompt[0].tolist(), n + 8)
    lm.drafter = oracle_drafter(reference, target.config.vocab_size, corruption_rate=0.2)
    return lm


def test_text_streamer_prints_what_transformers_prints(stories260k, prompt, capsys):
    """TextStreamer (prompt included) prints the same text for SpeculativeLM as for target.generate."""
    target, tokenizer = stories260k
    out = make_lm(target).generate(
        prompt, max_new_tokens=40, streamer=TextStreamer(tokenizer, skip_special_tokens=True)
    )
    streamed = capsys.readouterr().out
    target.generate(
        prompt, max_new_tokens=40, do_sample=False, streamer=TextStreamer(tokenizer, skip_special_tokens=True)
    )
    assert streamed == capsys.readouterr().out
    assert streamed == tokenizer.decode(out[0], skip_special_tokens=True) + "\n"


def test_text_iterator_streamer_yields_the_decoded_new_tokens(
    stories260k, prompt, greedy_reference, oracle_drafter
):
    """TextIteratorStreamer (skip_prompt) consumed in another thread: the text equals decode(new tokens)."""
    target, tokenizer = stories260k
    lm = oracle(target, prompt, greedy_reference, oracle_drafter, 60)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    result = {}
    thread = Thread(
        target=lambda: result.setdefault("out", lm.generate(prompt, max_new_tokens=60, streamer=streamer))
    )
    thread.start()
    chunks = list(streamer)
    thread.join()
    out = result["out"]
    assert "".join(chunks) == tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert lm.last_stats["mean_accepted"] > 1.5  # several tokens per put


def test_streamer_protocol_prompt_first_then_accepted_chunks(
    stories260k, prompt, greedy_reference, oracle_drafter
):
    """put(prompt) first, then the new tokens in accepted chunks (no token twice, none missing), end() once."""
    target, _ = stories260k
    lm = oracle(target, prompt, greedy_reference, oracle_drafter, 30)
    streamer = RecordingStreamer()
    out = lm.generate(prompt, max_new_tokens=30, streamer=streamer)
    assert streamer.puts[0] == prompt[0].tolist()
    assert sum(streamer.puts[1:], []) == out[0, prompt.shape[1] :].tolist()
    assert all(streamer.puts[1:]) and max(len(chunk) for chunk in streamer.puts[1:]) > 1
    assert streamer.ended == 1


def test_streamer_stops_at_eos_and_at_zero_tokens(stories260k, prompt):
    """The streamed tokens end with EOS when generation stops there; max_new_tokens=0 streams only the prompt."""
    target, _ = stories260k
    lm = make_lm(target, "medusa")
    free = lm.generate(prompt, max_new_tokens=12, eos_token_id=[])[0, prompt.shape[1] :].tolist()
    eos = free[6]
    streamer = RecordingStreamer()
    out = lm.generate(prompt, max_new_tokens=12, eos_token_id=eos, streamer=streamer)
    streamed = sum(streamer.puts[1:], [])
    assert streamed == out[0, prompt.shape[1] :].tolist() == free[: free.index(eos) + 1]
    streamer = RecordingStreamer()
    lm.generate(prompt, max_new_tokens=0, streamer=streamer)
    assert streamer.puts == [prompt[0].tolist()] and streamer.ended == 1
