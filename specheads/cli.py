"""The `specheads` command line: demo, train, data, generate, chat, serve, bench, bench-serve, eval, export, import."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BATCHING = {"auto": None, "on": True, "off": False}  # --batching -> serial_engine.engine_for's batching=


def _add_decoding_options(p: argparse.ArgumentParser) -> None:
    """The model, decoding and CPU-kernel options `generate`, `chat` and `serve` share."""
    # torch is loaded by now (the package imports it)
    from specheads.drafting_options import add_drafting_options
    from specheads.inference.certified_argmax import CPU_ARGMAX_CHOICES
    from specheads.inference.corpus_gate import MIN_GAIN, PROBE_EVERY
    from specheads.inference.corpus_lookup import SAVE_EVERY
    from specheads.inference.gqa_attention import CPU_ATTENTION_CHOICES
    from specheads.inference.int8_linear import DRAFT_LINEAR_CHOICES
    from specheads.inference.onednn import CPU_LINEAR_CHOICES
    from specheads.inference.prompts import add_chat_template_kwargs
    from specheads.inference.round_budget import parse_max_round_nodes

    p.add_argument("--target", default="stories260K", help="target path, Hub id, alias or peft adapter (default: stories260K)")
    add_drafting_options(p)  # --heads | --draft-model | --early-exit-layers | --mtp
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=None, help="default: the target's generation config")
    p.add_argument("--top-p", type=float, default=None, help="default: the target's generation config")
    p.add_argument("--top-k", type=int, default=None, help="default: the target's generation config (0 disables)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling, as transformers (default: generation config)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty (default: the target's generation config; 1.0 = none)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None,
                   help="ban repeating n-grams of this size, as transformers (default: the target's generation config)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="stop right after the text contains STRING (repeatable; transformers' stop_strings)")
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds (transformers' max_time)")
    p.add_argument("--cpu-linear", choices=CPU_LINEAR_CHOICES, default="auto",
                   help="CPU, float32: 'onednn' runs the linear layers on oneDNN (faster tree verification on some "
                   "CPUs); 'auto' (default): onednn for a float32 CPU target whose linear layers hold >= 1M weights, else default")
    p.add_argument("--draft-linear", choices=DRAFT_LINEAR_CHOICES, default="auto",
                   help="CPU, float32: 'int8' runs the heads' linear layers in int8 (cheaper drafting, same output); "
                   "'auto' (default): int8 for float32 CPU heads whose linear layers hold >= 1M weights, else default")
    p.add_argument("--cpu-attention", choices=CPU_ATTENTION_CHOICES, default="auto",
                   help="CPU: 'gqa' hands grouped keys/values to SDPA without copying them in tree forwards (same "
                   "output); 'auto' (default): gqa for a CPU target with grouped key/value heads, else default")
    p.add_argument("--cpu-argmax", choices=CPU_ARGMAX_CHOICES, default="auto",
                   help="CPU, float32, greedy: 'bf16' takes the target's argmax from a bf16 lm_head product with "
                   "certified error bounds (same output, cheaper verification); 'auto' (default): bf16 where it applies")
    p.add_argument("--tree", default=None, metavar="SPEC",
                   help="the draft tree: depth,top_k,nodes[,stop_prob[,min_prob]] for EAGLE / EAGLE-3 heads (e.g. "
                        "4,4,8,0.2,0.03, small trees for CPUs; stop_prob and min_prob left out are 0: no pruning), a "
                        "static tree's name or path for Medusa heads; default: "
                        "the heads' own for the device (on a CPU their config's cpu_tree, if any; `bench --tree auto "
                        "--save-tree DIR` writes a tuned one into a copy)")
    p.add_argument("--lookup-tokens", type=int, default=0,
                   help="graft a prompt-lookup guess of up to N tokens onto each draft tree (0: off)")
    p.add_argument("--lookup-max-tokens", type=int, default=None,
                   help="let the guess double, up to N tokens, while whole guesses are accepted (default: fixed length)")
    p.add_argument("--lookup-corpus", default=None, metavar="PATH",
                   help="graft the continuations of the context's longest match in a corpus of the target's answers "
                   "onto each draft tree (`specheads data lookup-corpus` writes one; a file or a folder holding "
                   "lookup_corpus.npy)")
    p.add_argument("--corpus-tokens", type=int, default=8, help="the corpus' guessed nodes per round, at most (default 8)")
    p.add_argument("--corpus-learn", type=int, default=0, metavar="N",
                   help="corpus lookup learns every answer given, keeping the latest N tokens of them (with or without "
                   "--lookup-corpus; repeated tasks get guessed whole; default 0: off)")
    p.add_argument("--corpus-min-gain", type=float, default=MIN_GAIN, metavar="G",
                   help="graft the corpus' guesses only while they earn G accepted tokens per node they add, in the "
                   f"request or after matches of the same length (a closed gate lets one round in {PROBE_EVERY} "
                   f"through; default {MIN_GAIN}; 0: always)")
    p.add_argument("--corpus-learned", default=None, metavar="FILE",
                   help="with --corpus-learn: keep the learned answers in FILE, read at start when it exists and "
                   "written (atomically) when the command ends (serve: on Ctrl-C or SIGTERM) and every "
                   "--corpus-save-every answers")
    p.add_argument("--corpus-save-every", type=int, default=SAVE_EVERY, metavar="K",
                   help="with --corpus-learned: write FILE again after every K answers learned, so that a process "
                   f"killed without a clean end loses fewer than K (default {SAVE_EVERY}; 0: only at the end)")
    p.add_argument("--max-round-nodes", type=parse_max_round_nodes, default=None,
                   help="batched decoding (serve, generate --prompts): tree nodes one round verifies at most, all rows "
                   "together; each row's tree shrinks to this // rows nodes, at 1 a plain step; 'auto': the nodes per "
                   "row chosen each round from the target's verification cost, measured at the start, and the rows' "
                   "measured drafting cost and acceptance (faster under load; a seeded sampled answer then depends on "
                   "the batch it ran in); 'full' (default): every row's full tree")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="batched decoding (serve, generate --prompts): a joining prompt with more tokens to run than "
                   "this prefills this many per round, so the answers already streaming wait at most one chunk's "
                   "forward (default: 256; 0: the whole prompt in one forward as it joins)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core; set it when other work shares the machine)")
    p.add_argument("--seed", type=int, default=0)
    add_chat_template_kwargs(p)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative generation: streams text, prints tau and tokens/s; or answers "
                       "a whole prompt file into JSONL, batched continuously")
    _add_decoding_options(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt: its answer is streamed")
    source.add_argument("--prompts", metavar="FILE",
                        help="every prompt of FILE (MT-bench style JSONL, first turns, or one prompt a line), answered "
                        "into --out as JSON lines, --max-batch at a time (rows join the batch as others end); a run "
                        "started again skips the ids already in --out")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="with --prompt and a vision-language target: an image the question is about (repeat for several; "
                        "the target's processor makes the prompt)")
    p.add_argument("--out", default=None, help="with --prompts: the answers' JSONL file (required)")
    p.add_argument("--max-batch", type=int, default=8, help="with --prompts: prompts decoded together (default: 8)")
    p.add_argument("--batching", choices=["auto", "on", "off"], default="auto",
                   help="with --prompts: decode up to --max-batch prompts together (on) or one after another (off); "
                   "auto: together, except on CUDA (one at a time on the fast path, faster there) and for hybrids")
    p.add_argument("--limit", type=int, default=None, help="with --prompts: the first N prompts only")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                            help="write JSON valid under this schema (a file or inline JSON; needs specheads[constraints]; "
                                 "'{\"type\": \"object\"}': any JSON object, without it)")
    constraint.add_argument("--regex", default=None, help="write text matching this regex (needs specheads[constraints])")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_const", const=True, default=None,
                      help="apply the tokenizer's chat template to the prompt (default: when the tokenizer has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_const", const=False,
                      help="feed the prompt as plain text even if the tokenizer has a chat template")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat (stdin lines; /retry, /reset, /exit), the cache kept "
                       "between turns")
    _add_decoding_options(p)
    p.add_argument("--system", default=None, help="a system message to open the conversation")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template instead of the tokenizer's (needed when it has none)")
    p.add_argument("--no-cache", action="store_true",
                   help="run the whole conversation through the target every turn (default: reuse its cache)")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="a vision-language target: the first message shows this image (repeat for several); "
                        "`/image FILE` in the chat attaches one to the next message")
    p.add_argument("--reasoning", default="auto", choices=["auto", "show", "hide", "raw"],
                   help="a reasoning model's <think> block: show (printed apart, dimmed on a terminal), hide (left out; "
                        "its length on stderr), raw (printed as written, tags and all), auto (show when the chat "
                        "template knows </think>, else raw; default)")
    p.add_argument("--tools", default=None, metavar="FILE_OR_JSON",
                   help="OpenAI-style function tools (a JSON list) shown to the model: each call it makes is printed "
                        "on stderr and the next input line is its result; the call format is read off the chat template")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/responses, "
                                          "streaming)")
    _add_decoding_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--cache-slots", type=int, default=4,
                   help="conversations whose target cache is kept between requests (default: 4; 0: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template instead of the tokenizer's")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests generated together at most (continuous batching: one target forward verifies "
                        "every row's tree; default: 8; 1: one at a time)")
    p.add_argument("--batching", choices=["auto", "on", "off"], default="auto",
                   help="concurrent requests batched (on) or answered one at a time (off); auto: batched, except on "
                   "CUDA (one at a time on the fast path, faster there than eager batched rounds) and for hybrids")
    p.add_argument("--api-key", default=os.environ.get("SPECHEADS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request (default: $SPECHEADS_API_KEY; unset: open)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "none", "hermes", "qwen3_coder", "llama3_json", "pythonic", "mistral"],
                   help="how tool calls are read out of answers to requests with tools and tool_choice 'auto': "
                        "hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes, SmolLM3), qwen3_coder "
                        "(<tool_call><function=...><parameter=...>: Qwen3-Coder, Qwen3.5), llama3_json (Llama 3.1-3.3), "
                        "pythonic ([name(key=value)]: Llama 4, Gemma 3), mistral ([TOOL_CALLS]), auto (the one the "
                        "chat template shows; default), none ('required' and named tool_choice still work: the answer "
                        "is constrained to the calls' JSON)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "think"],
                   help="split chat answers' <think>...</think> block off as message.reasoning_content: think "
                        "(Qwen3, QwQ, DeepSeek-R1), auto (think when the chat template knows </think>; default), none "
                        "(the whole answer is content)")
    p.add_argument("--responses-store", type=int, default=1000, metavar="N",
                   help="/v1/responses responses kept in memory for previous_response_id and GET /v1/responses/{id}, "
                        "the least recently used forgotten past N (default: 1000; 0: none)")
    p.add_argument("--responses-dir", default=None, metavar="DIR",
                   help="also keep the stored responses as JSON files in DIR: previous_response_id survives a restart")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="append every answered request to FILE (JSONL: chat requests in OpenAI format, the messages "
                        "then each answer as the assistant's turn; completions as {prompt, completion}) to train heads "
                        "on this traffic: specheads train data.source=FILE. The file holds users' prompts and answers")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    # a request without max_tokens runs to the end of the context (OpenAI's default) unless the server sets one
    p.set_defaults(max_new_tokens=None)


def build_server(args: argparse.Namespace):
    """The HTTP server `specheads serve` runs (not yet serving)."""
    from specheads.inference.chat import read_chat_template
    from specheads.inference.multimodal import image_processor_for
    from specheads.inference.serial_engine import SerialEngine
    from specheads.inference.server import CompletionService, make_server
    from specheads.inference.tree import tree_spec

    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    lm, kernels = _load_lm(args)
    defaults = {k: v for k, v in _generate_options(args).items() if v is not None}
    processor = image_processor_for(args.target)  # a vision-language target's: chat requests may hold images
    service = CompletionService(lm, args.served_model_name or args.target, defaults, args.cache_slots, template,
                                args.api_key, args.max_batch, processor, args.chat_template_kwargs,
                                None if args.tool_call_parser == "none" else args.tool_call_parser,
                                None if args.reasoning_parser == "none" else args.reasoning_parser,
                                args.responses_store, args.responses_dir, args.record, BATCHING[args.batching])
    service.warm_up()
    server = make_server(service, args.host, args.port, quiet=args.quiet)
    host, port = server.server_address[:2]
    budget = ""
    if lm.max_round_nodes == "auto":  # measured when the serving loop started
        costs = lm.verification_ms_by_tokens()
        budget = "; node budget auto, verification " + ", ".join(
            f"{t} tokens {costs[t]:.1f} ms" for t in (1, 16, 128) if t in costs)
    tools = f"; tool calls read as {service.tool_parser.name}" if service.tool_parser else ""
    tools += f"; reasoning read as {service.reasoning_parser.name}" if service.reasoning_parser else ""
    tools += f"; answers recorded to {args.record}" if args.record else ""
    serial = isinstance(service.loop.engine, SerialEngine)
    batching = "requests one at a time" if serial else f"requests in batches of up to {args.max_batch}"
    print(f"[specheads] serving {service.model_name!r} at http://{host}:{port}/v1 (OpenAI API; tree "
          f"{tree_spec(lm.tree_description())}; {batching}; {', '.join(f'{k}={v}' for k, v in kernels.items())}{budget}"
          f"{tools})",
          file=sys.stderr, flush=True)
    return server


def run_serve(args: argparse.Namespace) -> int:
    import signal

    server = build_server(args)
    service = server.RequestHandlerClass.service

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (a service manager's stop) ends the server as Ctrl-C does

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
        service.close()  # the serving loop's thread
        _save_learned(service.lm, args)
    return 0


def _load_lm(args: argparse.Namespace):
    """The SpeculativeLM the decoding options ask for, on the CPU kernels they choose: (lm, kernel choices)."""
    import torch

    from specheads.drafting_options import drafting_kwargs
    from specheads.inference.corpus_lookup import corpus_from_options
    from specheads.inference.generate import SpeculativeLM
    from specheads.inference.lookup import check_lookup_settings

    # before loading any model
    check_lookup_settings(args.lookup_tokens, lookup_max_tokens=args.lookup_max_tokens, corpus_tokens=args.corpus_tokens)
    corpus = corpus_from_options(args.lookup_corpus, args.corpus_learn, args.corpus_min_gain, args.corpus_learned,
                                 args.corpus_save_every)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: expected a number of CPU threads >= 1")
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk}: expected 0 (off) or a number of tokens")
    lm = SpeculativeLM.from_pretrained(target=args.target, **drafting_kwargs(args), lookup_tokens=args.lookup_tokens,
                                      lookup_max_tokens=args.lookup_max_tokens, lookup_corpus=corpus,
                                      corpus_tokens=args.corpus_tokens, max_round_nodes=args.max_round_nodes,
                                      prefill_chunk=args.prefill_chunk or None)
    if args.tree:
        from specheads.inference.tree import tree_options

        lm.configure_tree(**tree_options(args.tree))
    kernels = lm.use_cpu_kernels(args.cpu_linear, args.draft_linear, args.cpu_attention, args.cpu_argmax)
    return lm, kernels


def _save_learned(lm, args: argparse.Namespace) -> None:
    """`--corpus-learned FILE`: write what the corpus lookup learned (the command is ending)."""
    corpus = getattr(lm.drafter, "corpus", None)
    if args.corpus_learned is not None and corpus is not None:
        path = corpus.save_learned(args.corpus_learned)
        print(f"[specheads] {corpus.learned_tokens} learned corpus tokens written to {path}",
              file=sys.stderr, flush=True)


def _generate_options(args: argparse.Namespace) -> dict:
    """`generate` keyword arguments from the decoding options."""
    return dict(
        max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, stop_strings=args.stop, max_time=args.max_time,
    )


def _stats_line(stats: dict, kernels: dict | None = None, tree: str | None = None) -> str:
    line = f"[specheads] {stats['new_tokens']} tokens, tau={stats['mean_accepted']:.2f}, {stats['tokens_per_second']:.1f} tokens/s"
    if "prompt_tokens" in stats:
        line += f", prompt {stats['prompt_tokens']} tokens ({stats['reused_prompt_tokens']} reused)"
    details = ([f"tree {tree}"] if tree else []) + ([", ".join(f"{k}={v}" for k, v in kernels.items())] if kernels else [])
    if details:
        line += f" ({'; '.join(details)})"
    return line


def run_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from specheads.inference.constraints import constraint_from_options
    from specheads.inference.prompts import tokenize_prompts
    from specheads.inference.tree import tree_spec

    if args.prompts is not None:
        if args.image:
            raise ValueError("--image goes with --prompt (one question about the images), not --prompts")
        return run_generate_file(args)
    images: dict = {}
    if args.image:  # before loading the model: a missing image or processor fails fast
        from specheads.inference.multimodal import image_prompt

        input_ids, images, _ = image_prompt(args.target, args.prompt, args.image, chat=args.chat,
                                            template_kwargs=args.chat_template_kwargs)
    lm, kernels = _load_lm(args)
    tokenizer = lm.tokenizer
    if not args.image:
        # the same rule as `specheads bench`: a chat model answers its chat template, not raw text
        prompt = {"prompt_id": "cli", "category": "cli", "text": args.prompt}
        input_ids = tokenize_prompts([prompt], tokenizer, chat=args.chat,
                                     template_kwargs=args.chat_template_kwargs)[0].input_ids  # (1, n)
    constraint = constraint_from_options(tokenizer, args.json_schema, args.regex)
    processors = None if constraint is None else [constraint]
    streamer = TextStreamer(tokenizer, skip_prompt=False, skip_special_tokens=True)
    lm.generate(input_ids, logits_processor=processors, streamer=streamer, **_generate_options(args), **images)
    print("\n" + _stats_line(lm.last_stats, kernels, tree_spec(lm.tree_description())), file=sys.stderr)
    _save_learned(lm, args)
    return 0


def run_generate_file(args: argparse.Namespace) -> int:
    """`generate --prompts FILE --out F`: every prompt's answer, batched continuously (inference/batch_file.py)."""
    from specheads.inference.batch_file import generate_file
    from specheads.inference.constraints import constraint_from_options
    from specheads.inference.multimodal import image_processor_when_asked
    from specheads.inference.prompts import read_prompts, tokenize_prompts

    if args.out is None:
        raise ValueError("generate --prompts needs --out FILE (the answers' JSONL)")
    rows = read_prompts(args.prompts, limit=args.limit)  # before loading the model: a bad path fails fast
    lm, kernels = _load_lm(args)
    prompts = tokenize_prompts(rows, lm.tokenizer, chat=args.chat, processor=image_processor_when_asked(rows, args.target),
                               template_kwargs=args.chat_template_kwargs)
    constraint = constraint_from_options(lm.tokenizer, args.json_schema, args.regex)
    try:
        totals = generate_file(lm, prompts, args.out, args.max_batch, args.seed, constraint,
                               batching=BATCHING[args.batching], **_generate_options(args))
    finally:  # an interrupted job keeps what it learned, as it keeps the answers written
        _save_learned(lm, args)
    print(f"[specheads] {totals['answered']} answers ({totals['skipped']} already in {args.out}), "
          f"{totals['new_tokens']} tokens, tau={totals['mean_accepted']:.2f}, {totals['tokens_per_second']:.1f} "
          f"tokens/s ({', '.join(f'{k}={v}' for k, v in kernels.items())})", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """The chat loop: one user message per stdin line; `/retry` answers the last message again, `/reset` starts over,
    `/exit` (or end of input) quits, Ctrl-C during an answer drops that turn."""
    from specheads.inference.chat import ChatSession, read_chat_template
    from specheads.inference.multimodal import image_processor_for, takes_images
    from specheads.inference.tree import tree_spec

    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    lm, kernels = _load_lm(args)
    processor = image_processor_for(args.target) if takes_images(lm.target) else None
    if args.image and processor is None:
        raise ValueError(f"--image needs a vision-language target with an image processor; {args.target!r} has none")
    tools = None if args.tools is None else _read_tools(args.tools)
    session = ChatSession(lm, system=args.system, chat_template=template, reuse_cache=not args.no_cache,
                          processor=processor, chat_template_kwargs=args.chat_template_kwargs, tools=tools,
                          **_generate_options(args))
    print(f"[specheads] chat with {args.target} (tree {tree_spec(lm.tree_description())}; "
          f"{', '.join(f'{k}={v}' for k, v in kernels.items())}); "
          f"/retry answers again, /reset starts over, {'/image FILE attaches an image, ' if processor else ''}"
          "/exit quits", file=sys.stderr)
    reasoning = args.reasoning
    if reasoning == "auto":
        from specheads.inference.reasoning import detect_reasoning_parser

        shown = template or getattr(processor or lm.tokenizer, "chat_template", None)
        reasoning = "show" if detect_reasoning_parser(shown if isinstance(shown, str) else None) else "raw"
    try:
        _chat_loop(session, list(args.image or []), reasoning)
    finally:
        _save_learned(lm, args)
    return 0


def _read_tools(value: str) -> list:
    """`--tools`: a JSON list of OpenAI-style tools, or a file holding one."""
    try:
        return json.loads(value if value.lstrip().startswith("[") else Path(value).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--tools {value!r}: expected a JSON list of tools, or a file holding one ({err})") from None


def _chat_loop(session, images: list[str], reasoning: str = "raw") -> None:
    """Answer stdin's lines until /exit or the end of input; `images` (and each `/image FILE`) go with the next
    message; `reasoning`: how a think block prints ("show", "hide", "raw": `ReasoningStreamer`)."""
    from transformers import TextStreamer

    from specheads.inference.chat import ReasoningStreamer

    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            session.reset()
            images = []
            print("[specheads] new conversation", file=sys.stderr)
            continue
        if text.startswith("/image "):
            path = text[len("/image "):].strip()
            if session.processor is None or not Path(path).is_file():
                why = "the target takes no images" if session.processor is None else f"no file {path!r}"
                print(f"[specheads] /image: {why}", file=sys.stderr)
            else:
                images.append(path)
                print(f"[specheads] {path} goes with the next message", file=sys.stderr)
            continue
        def streamer():
            return (TextStreamer(session.tokenizer, skip_prompt=True, skip_special_tokens=True) if reasoning == "raw"
                    else ReasoningStreamer(session.tokenizer, show_reasoning=reasoning == "show"))

        if text == "/retry" and not (session.messages and session.messages[-1]["role"] == "assistant"):
            print("[specheads] /retry: there is no answer to give again yet", file=sys.stderr)
            continue
        printer = streamer()
        try:
            if text == "/retry":
                session.regenerate(streamer=printer)
            else:
                session.ask(text, streamer=printer, images=images)
                images = []
        except KeyboardInterrupt:
            print("\n[specheads] interrupted: the turn is dropped", file=sys.stderr)
            continue
        if reasoning == "hide" and printer.reasoning_chars:
            print(f"[specheads] reasoning hidden ({printer.reasoning_chars} characters; --reasoning show prints it)",
                  file=sys.stderr)
        print(_stats_line(session.last_stats), file=sys.stderr, flush=True)
        while session.last_calls:  # --tools: each call's result is the next input line, then the model goes on
            for call in session.last_calls:
                print(f"[specheads] tool call {call.name}({call.arguments}) [{call.id}]: its result?", file=sys.stderr,
                      flush=True)
                result = sys.stdin.readline()
                if not result:
                    return
                session.add_tool_result(call.id, result.rstrip("\n"))
            session.reply(streamer=streamer())
            print(_stats_line(session.last_stats), file=sys.stderr, flush=True)


USER_ERRORS = (ValueError, TypeError, FileNotFoundError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Errors a user can cause print one clear line and exit with status 2
    (set SPECHEADS_TRACEBACK=1 to see the full traceback)."""
    try:
        return _dispatch(argv)
    except USER_ERRORS as err:
        if os.environ.get("SPECHEADS_TRACEBACK") == "1":
            raise
        print(f"specheads: error: {err}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str] | None) -> int:
    from specheads.checkpoint_cli import CHECKPOINT_COMMANDS, add_checkpoint_commands, run_checkpoint_command

    parser = argparse.ArgumentParser(prog="specheads", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="main job on the embedded target: data -> features -> train -> benchmark")
    demo.add_argument("--out", default="demo_out", help="output folder (heads/ and results.json)")
    demo.add_argument("--quick", action="store_true", help="a much shorter run (smoke test)")

    train = sub.add_parser("train", help="train heads (or distil a draft model: head.type=draft_model): "
                                            "specheads train [CONFIG.yaml] [key=value ...]")
    train.add_argument("config", help="run config YAML (see configs/train/); or start with key=value overrides to "
                                      "train from the defaults, e.g. specheads train head.type=eagle3 data.source=D")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=100")

    # These subcommands parse their own arguments (their modules own the options).
    sub.add_parser("data", help="data tools: regenerate responses, dump target features", add_help=False)

    _add_generate(sub)
    _add_chat(sub)
    _add_serve(sub)

    sub.add_parser("bench", help="benchmark speculative vs plain decoding (JSON out)", add_help=False)
    sub.add_parser("bench-serve", help="load-test an OpenAI-compatible server: TTFT, TPOT, throughput by concurrency "
                                       "(JSON out)", add_help=False)
    sub.add_parser("eval", help="score heads on held-out text: per-depth accuracy, simulated tau (JSON out)",
                   add_help=False)

    add_checkpoint_commands(sub)  # export, import, info, push: specheads/checkpoint_cli.py

    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("data", "bench", "bench-serve", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from specheads.training.demo import run_demo

        results = run_demo(args.out, quick=args.quick)
        print(json.dumps(results, indent=2))
        return 0
    if args.command == "train":
        from specheads.training.train import train_from_config_file

        train_from_config_file(args.config, args.overrides)
        return 0
    if args.command == "data":
        from specheads.training.data_cli import data_main

        return data_main(rest)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "chat":
        return run_chat(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "bench":
        from specheads.inference.bench import bench_main

        return bench_main(rest)
    if args.command == "bench-serve":
        from specheads.inference.serve_bench import bench_serve_main

        return bench_serve_main(rest)
    if args.command == "eval":
        from specheads.training.eval_cli import eval_main

        return eval_main(rest)
    if args.command in CHECKPOINT_COMMANDS:
        return run_checkpoint_command(args, parser)
    parser.error(f"unknown command {args.command}")
    return 2
