"""Answers for every prompt of a file, batched continuously: `specheads generate --prompts FILE --out answers.jsonl`.

Up to `max_batch` prompts are decoded together (`BatchEngine`); when one ends, the next prompt of the file takes its
place at the next round, so a batch never idles behind its longest answer (as a static batch does). Each answer is
exactly what `generate` gives for that prompt alone: greedy identical to the target's, and sampled answers drawn from
a generator of their own seeded by `seed` + the prompt's index in the file, so they do not depend on the batch size,
on the order prompts end in, or on a resumed run. Records are appended as answers end, one JSON line each, and a
run started again skips the ids already written (a line torn by a killed run is dropped first).
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specheads.inference.batched import BatchRequest
from specheads.inference.openai_api import finish_reason
from specheads.inference.prompts import Prompt
from specheads.inference.serial_engine import engine_for
from specheads.training.data_cli import done_ids, drop_torn_line


def generate_file(
    lm: Any,
    prompts: list[Prompt],
    out: str | Path,
    max_batch: int = 8,
    seed: int = 0,
    constraint: Any = None,
    show_progress: bool = True,
    batching: bool | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Answer `prompts` into the JSONL file `out` ({"id", "category", "prompt", "answer", "new_tokens", "tau",
    "finish_reason"} per line, in the order answers end); returns the run's totals.

    Args:
        lm: the `SpeculativeLM`.
        prompts: tokenised prompts (`inference/prompts.py`), ids unique.
        max_batch: prompts decoded together at most.
        seed: sampled answers: prompt i draws from a generator seeded `seed + i`.
        constraint: an `IndexConstraint` (JSON schema / regex) every answer follows (a fresh copy each).
        batching: `serial_engine.engine_for`'s: None (auto: batched, but one prompt at a time on CUDA, on the fast
            path, and for hybrid targets), True or False.
        **options: `generate`'s decoding options (max_new_tokens, do_sample, temperature, stop_strings, ...).
    """
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r}: expected an integer >= 1")
    ids = [p.prompt_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompt ids repeat ({len(ids) - len(set(ids))} duplicates): each answer is stored by its id")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    drop_torn_line(out)
    written = done_ids(out)
    todo = deque((index, p) for index, p in enumerate(prompts) if p.prompt_id not in written)
    already = len(prompts) - len(todo)  # answered by an earlier run
    engine = engine_for(lm, batching)  # on CUDA and for hybrids: one after another (inference/serial_engine.py)
    asked: dict[int, Prompt] = {}  # id(request) -> its prompt
    start, tokens, forwards, answered = time.perf_counter(), 0, 0, 0
    bar = tqdm(total=len(prompts), initial=already, desc="generate", unit="prompt",
               disable=not show_progress)
    with out.open("a") as f:
        while todo or engine.occupied:
            joining = []
            while todo and engine.occupied + len(joining) < max_batch:
                index, prompt = todo.popleft()
                request = lm.batch_request(
                    prompt.input_ids.to(lm.target.device), seed=seed + index if options.get("do_sample") else None,
                    logits_processor=None if constraint is None else [constraint.fresh()], inputs=prompt.inputs,
                    **options)
                asked[id(request)] = prompt
                joining.append(request)
            ended = engine.add(joining) if joining else []
            if engine.occupied:
                ended += engine.step()
            for request in ended:
                tokens += len(request.new_tokens)
                forwards += request.target_forwards
                answered += 1
                f.write(json.dumps(_record(lm, request, asked.pop(id(request)))) + "\n")
            f.flush()
            bar.update(len(ended))
    bar.close()
    seconds = time.perf_counter() - start
    return {"prompts": len(prompts), "answered": answered, "skipped": already, "new_tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "mean_accepted": tokens / forwards if forwards else 0.0}


def _record(lm: Any, request: BatchRequest, prompt: Prompt) -> dict[str, Any]:
    return {
        "id": prompt.prompt_id, "category": prompt.category, "prompt": prompt.text,
        "answer": lm.tokenizer.decode(request.new_tokens, skip_special_tokens=True),
        "new_tokens": len(request.new_tokens), "tau": request.mean_accepted,
        "finish_reason": finish_reason(False, request.new_tokens, request.max_new_tokens, request.eos),
    }
