"""Prompts written by the target itself (Magpie): more training prompts when a prompt set runs out.

An instruction-tuned model has learned what its users ask. Given its chat template up to where a user's message
begins (for SmolLM2: the system turn, then `<|im_start|>user\\n`), it writes a user message; sampled at
temperature 1, each is a new prompt from the distribution it was tuned on (Xu et al. 2024, "Magpie: alignment
data synthesis from scratch by prompting aligned LLMs with nothing"). Draft heads learn from the target's own
answers, and they fit the prompts they were trained on far better than unseen ones (`specheads eval`: depth-1
accuracy 0.80 on training answers, 0.66 on unseen ShareGPT prompts, 0.56 on MT-bench), while the ShareGPT
package holds only ~51k distinct human turns. `synthesize_prompts` writes as many new prompts as the budget
allows; `specheads data regenerate` then answers them like any other prompt file.

Openings steer the kind of prompt: with `openings=["Write a poem", ...]` each user message starts with one of them
(given to the model as the start of its message) and the model writes the rest, so a run can aim at the kinds of
task (creative writing, role-play, explanations) that a benchmark's categories hold and the unsteered prompts lack.

Kept: messages the model finished (its end-of-turn token within `max_new_tokens`) of at least `min_chars`
characters, not written before (case- and whitespace-normalised), and sharing no run of `overlap_words` words
with a benchmark prompt (`exclude`): heads are never trained on what they are measured on, nor on near copies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.training.data_cli import drop_torn_line, generate_batch
from specheads.training.preflight import check_writable_file
from specheads.training.sharegpt import benchmark_prompts

SENTINEL = "\u2063SPECHEADS_USER_MESSAGE\u2063"  # stands in for the user's message when the template is rendered
ID_PATTERN = re.compile(r"^synth-(\d+)-(\d+)$")  # record ids: synth-{batch:06d}-{row:04d}
MAX_BARREN_BATCHES = 10  # this many batches in a row without a kept prompt: the target cannot do this, stop


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase, system: str | None = None) -> tuple[list[int], int]:
    """The chat template up to where the user's message starts, as token ids, and the token that ends the turn.

    The template is rendered around a sentinel message: what precedes it is the prefix (the template's default
    system turn included), and the first token after it must be a special token (ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`, ...): generation stops there.

    Raises:
        ValueError: the tokenizer has no chat template, or its user turn does not end with a special token.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"synthesizing prompts needs a chat template; {type(tokenizer).__name__} "
            f"({tokenizer.name_or_path!r}) has none (an instruction-tuned target has one)"
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    if SENTINEL not in rendered:
        raise ValueError(f"{tokenizer.name_or_path!r}: the chat template does not render the user's message verbatim")
    before, after = rendered.split(SENTINEL, 1)
    prefix = tokenizer(before, add_special_tokens=False).input_ids
    closing = tokenizer(after, add_special_tokens=False).input_ids
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if not closing or closing[0] not in special:
        raise ValueError(
            f"{tokenizer.name_or_path!r}: the chat template ends a user turn with {after[:20]!r}, which does not start "
            "with a special token; expected one (e.g. <|im_end|>) to stop the generated message at"
        )
    return prefix, closing[0]


def check_openings(openings: list[str] | None) -> None:
    """Raise a ValueError naming the first opening that is not a non-empty text (the CLI calls it before loading)."""
    for opening in openings or ():
        if not isinstance(opening, str) or not opening.strip():
            raise ValueError(f"opening={opening!r}; expected a non-empty text the user message starts with")


def normalised(text: str) -> str:
    """Lower case, whitespace runs as one space: the key under which prompts count as the same."""
    return " ".join(text.lower().split())


def word_runs(text: str, length: int) -> set[tuple[str, ...]]:
    """Every run of `length` consecutive words (lower case, punctuation dropped) in `text`."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i: i + length]) for i in range(len(words) - length + 1)}


class PromptFilter:
    """Which generated messages to keep (see the module docstring); remembers the kept ones.

    Args:
        benchmark: prompts never to train on (`sharegpt.benchmark_prompts`); None: none.
        min_chars: shorter messages are dropped.
        overlap_words: a message sharing a run of this many words with a benchmark prompt is dropped (and one
            equal to a benchmark prompt, however short).
    """

    def __init__(self, benchmark: set[str] | None = None, min_chars: int = 16, overlap_words: int = 8) -> None:
        if overlap_words < 1:
            raise ValueError(f"overlap_words={overlap_words}; expected at least 1")
        self.min_chars, self.overlap_words = min_chars, overlap_words
        self.benchmark = {normalised(t) for t in benchmark or ()}
        self.benchmark_runs: set[tuple[str, ...]] = set()
        for text in self.benchmark:
            self.benchmark_runs |= word_runs(text, overlap_words)
        self.seen: set[str] = set()

    def reject_reason(self, text: str, finished: bool) -> str | None:
        """Why `text` is dropped ('unfinished', 'short', 'duplicate', 'benchmark'), or None to keep it."""
        key = normalised(text)
        if not finished:
            return "unfinished"
        if len(key) < self.min_chars:
            return "short"
        if key in self.seen:
            return "duplicate"
        if key in self.benchmark or not self.benchmark_runs.isdisjoint(word_runs(key, self.overlap_words)):
            return "benchmark"
        return None

    def remember(self, text: str) -> None:
        self.seen.add(normalised(text))


def read_synthesized(output: Path) -> tuple[list[str], int, int]:
    """The prompts an earlier (possibly interrupted) run wrote to `output`, and where it stopped: the batch and
    row after its last kept prompt (0, 0 for a new file)."""
    texts: list[str] = []
    position = (0, -1)
    if output.is_file():
        for line in output.read_text().split("\n"):  # not splitlines(): U+2028 may be inside a string
            try:
                record = json.loads(line)
                content = record["messages"][0]["content"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                continue
            texts.append(content)
            match = ID_PATTERN.match(str(record.get("id")))
            if match:
                position = max(position, (int(match.group(1)), int(match.group(2))))
    return texts, position[0], position[1] + 1


def synthesize_prompts(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output: str | Path,
    count: int,
    batch_size: int = 64,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    exclude: str | Path | None = None,
    min_chars: int = 16,
    overlap_words: int = 8,
    system: str | None = None,
    openings: list[str] | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Have the target write user prompts until `output` (JSONL, appended to) holds `count` of them.

    Records are `{"id": "synth-BBBBBB-RRRR", "messages": [{"role": "user", "content": ...}]}` (OpenAI format, what
    `regenerate --input` reads). Batch b is sampled with seed `seed * 1_000_003 + b` and a run goes on after the
    last prompt in the file (its batch sampled again, the rows up to it skipped), so a resumed run (even after
    kill -9) writes what an uninterrupted one would have, and a run asked for more writes what one run asked for
    that many would have.

    Args:
        count: prompts the file should hold when done.
        exclude: benchmark prompts (MT-bench JSONL or text lines) no kept prompt may match or quote.
        system: a system message to render before the user turn (default: the template's own).
        openings: texts the user messages start with (row r of every batch starts with `openings[r % len]`; the
            model writes the rest; kept prompts include the opening). A resumed run needs the same openings.

    Returns:
        {"output", "kept" (prompts in the file), "written" (by this call), "generated" (messages this call
        judged: written + rejected), "rejected": {reason: count}}.

    Raises:
        ValueError: bad arguments or a template without a user turn to continue (`user_turn_prefix`).
        RuntimeError: `MAX_BARREN_BATCHES` batches in a row gave no prompt worth keeping.
    """
    for name, value in (("count", count), ("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name}={value}; expected at least 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}; synthesizing prompts needs sampling (> 0), greedy repeats one")
    check_openings(openings)
    prefix, end_of_turn = user_turn_prefix(tokenizer, system)
    opening_ids = [tokenizer(o, add_special_tokens=False).input_ids for o in openings] if openings else [[]]
    row_openings = [opening_ids[row % len(opening_ids)] for row in range(batch_size)]  # [] for all without openings
    row_prompts = [prefix + opening for opening in row_openings]
    stops = [end_of_turn] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id not in (None, end_of_turn) else [])
    output = check_writable_file(output, "synth-prompts output")
    drop_torn_line(output)
    keep = PromptFilter(benchmark_prompts(exclude) if exclude else None, min_chars, overlap_words)
    earlier, batch, first_row = read_synthesized(output)
    for text in earlier:
        keep.remember(text)
    kept, written, generated, barren = len(earlier), 0, 0, 0
    rejected: dict[str, int] = {}
    bar = tqdm(total=count, initial=min(kept, count), desc="synth-prompts", unit="prompt", disable=not show_progress)
    with output.open("a") as f:
        while kept < count:
            rows = generate_batch(target, tokenizer, row_prompts, max_new_tokens, temperature,
                                  seed * 1_000_003 + batch, stop_token_ids=stops)
            before = kept
            for row_number, tokens in enumerate(rows):
                if row_number < first_row:  # seen by the run this one resumes
                    continue
                generated += 1
                finished = bool(tokens) and tokens[-1] in stops
                own = tokens[:-1] if finished else tokens  # what the model wrote (after the opening, if any)
                opening = row_openings[row_number]
                text = tokenizer.decode(opening + own, skip_special_tokens=True).strip()
                reason = keep.reject_reason(text, finished)
                if reason is None and opening and not tokenizer.decode(own, skip_special_tokens=True).strip():
                    reason = "short"  # an opening alone is no prompt
                if reason is not None:
                    rejected[reason] = rejected.get(reason, 0) + 1
                    continue
                keep.remember(text)
                record = {"id": f"synth-{batch:06d}-{row_number:04d}", "messages": [{"role": "user", "content": text}]}
                f.write(json.dumps(record) + "\n")
                kept += 1
                written += 1
                if kept == count:
                    break
            f.flush()
            bar.update(kept - before)
            barren = barren + 1 if kept == before else 0
            if barren == MAX_BARREN_BATCHES:
                raise RuntimeError(
                    f"{MAX_BARREN_BATCHES} batches of {batch_size} gave no prompt worth keeping (rejected so far: "
                    f"{rejected}); raise max_new_tokens if most are 'unfinished'"
                )
            batch, first_row = batch + 1, 0
    bar.close()
    return {"output": str(output), "kept": kept, "written": written, "generated": generated, "rejected": rejected}
