"""The `specheads` command line: help texts, and `generate` on the embedded target with saved heads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specheads.cli import main
from specheads.inference.certified_argmax import wants_certified_argmax


def test_module_help():
    """`python -m specheads --help` exits 0 and lists every subcommand."""
    result = subprocess.run(
        [sys.executable, "-m", "specheads", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: specheads" in result.stdout
    for command in ("demo", "train", "data", "generate", "chat", "bench"):
        assert command in result.stdout


def test_generate_help(capsys):
    """`specheads generate --help` exits 0 and documents its options."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: specheads generate" in out
    for option in ("--target", "--heads", "--prompt", "--max-new-tokens", "--do-sample", "--temperature"):
        assert option in out


def test_unknown_command_is_a_usage_error(capsys):
    """An unknown subcommand exits with argparse's usage error (code 2), not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _generate(heads_dir, capfd) -> tuple[str, str]:
    code = main(
        ["generate", "--heads", str(heads_dir), "--prompt", "Once upon a time", "--max-new-tokens", "20"]
    )
    assert code == 0
    return capfd.readouterr()


def test_generate_streams_text_and_prints_tau(stories260k_eagle_dir, capfd, stories260k):
    """`specheads generate` with untrained EAGLE heads streams the target's own greedy text and prints tau."""
    out, err = _generate(stories260k_eagle_dir, capfd)
    # Lossless: whatever the heads draft, greedy output is the target's (the model README's story).
    assert out.removeprefix("<s>").lstrip().startswith("Once upon a time, there was a little girl named Lily")
    assert "20 tokens" in err
    tau = float(err.split("tau=")[1].split(",")[0])
    assert 1.0 <= tau <= 1 + 6  # at least the target's own token per forward, at most tree depth + 1
    assert "tokens/s" in err
    argmax = "bf16" if wants_certified_argmax("auto", stories260k[0]) else "default"  # needs oneDNN bf16 products
    # the kernels `auto` (every default) chose: stories260K's small layers keep the default linear kernels
    # with the tree drafted: the heads' default (no cpu_tree in their config)
    assert f"(tree 6,8,32,0,0; cpu_linear=default, draft_linear=default, cpu_attention=gqa, cpu_argmax={argmax})" in err


@pytest.mark.parametrize(("option", "kernels"), [
    (["--cpu-linear", "onednn"], "cpu_linear=onednn"),
    (["--lookup-tokens", "5"], "cpu_linear=default"),
    (["--draft-linear", "int8"], "draft_linear=int8"),
    (["--cpu-attention", "default"], "cpu_attention=default"),
], ids=["onednn", "lookup", "int8-heads", "repeated-kv-attention"])
def test_generate_options_keep_the_target_text(stories260k_eagle_dir, capfd, option, kernels):
    """`--cpu-linear onednn` (other fp32 kernels for the linear layers), `--lookup-tokens` (prompt lookup grafted
    onto the trees), `--draft-linear int8` (int8 heads) and `--cpu-attention default` (transformers' SDPA route
    instead of the default grouped one) keep the target's greedy text."""
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "20", *option])
    assert code == 0
    out, err = capfd.readouterr()
    assert out.removeprefix("<s>").lstrip().startswith("Once upon a time, there was a little girl named Lily")
    assert "20 tokens" in err
    assert kernels in err  # the kernels in use are printed


def test_tree_option_sets_the_draft_tree_of_generate_chat_and_serve(stories260k_eagle_dir, capfd):
    """`--tree` (the decoding options generate, chat and serve share) replaces the heads' own tree; the text stays
    the target's; a malformed spec is a clear error."""
    import argparse

    from specheads.cli import _add_decoding_options, _load_lm

    parser = argparse.ArgumentParser()
    _add_decoding_options(parser)
    lm, _ = _load_lm(parser.parse_args(["--heads", str(stories260k_eagle_dir), "--tree", "2,3,4,0.1,0.02"]))
    tree = lm.tree_description()
    assert (tree["depth"], tree["top_k"], tree["nodes"], tree["stop_prob"], tree["min_prob"]) == (2, 3, 4, 0.1, 0.02)
    lm, _ = _load_lm(parser.parse_args(["--heads", str(stories260k_eagle_dir)]))
    assert lm.tree_description()["nodes"] != 4  # the heads' own
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "20", "--tree", "1,1,1"])
    out, err = capfd.readouterr()
    assert code == 0 and out.removeprefix("<s>").lstrip().startswith("Once upon a time, there was a little girl named Lily")
    assert float(err.split("tau=")[1].split(",")[0]) <= 2  # one drafted node a round at most
    assert main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "x", "--tree", "5,8"]) == 2
    assert "expected depth,top_k,nodes" in capfd.readouterr().err


def test_generate_with_a_corpus_keeps_the_target_text(stories260k_eagle_dir, capfd, tmp_path):
    """`--lookup-corpus` (a corpus of the target's answers, here its own story) and `--corpus-learn` keep the
    target's greedy text; the known story is guessed whole, so far more is accepted per round."""
    from specheads.inference.corpus_lookup import CorpusLookup

    _, plain_err = _generate(stories260k_eagle_dir, capfd)
    story = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                  "--max-new-tokens", "40"])
    assert story == 0
    text = capfd.readouterr().out
    from transformers import AutoTokenizer

    from specheads.targets import resolve_target_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path("stories260K"))
    CorpusLookup([tokenizer(text.removeprefix("<s>").lstrip()).input_ids]).save(tmp_path)
    learned = tmp_path / "learned.npy"
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "20", "--lookup-corpus", str(tmp_path), "--corpus-learn", "500",
                 "--corpus-learned", str(learned)])
    assert code == 0
    out, err = capfd.readouterr()
    assert out.removeprefix("<s>").lstrip().startswith("Once upon a time, there was a little girl named Lily")
    tau = float(err.split("tau=")[1].split(",")[0])
    assert tau > float(plain_err.split("tau=")[1].split(",")[0]) + 1
    assert f"learned corpus tokens written to {learned}" in err
    # a later run without the fixed corpus starts from what the first one learned: the answer is guessed whole
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "20", "--corpus-learn", "500", "--corpus-learned", str(learned)])
    assert code == 0
    out, err = capfd.readouterr()
    assert out.removeprefix("<s>").lstrip().startswith("Once upon a time, there was a little girl named Lily")
    assert float(err.split("tau=")[1].split(",")[0]) > float(plain_err.split("tau=")[1].split(",")[0]) + 1


def test_generate_repetition_penalty_gives_transformers_text(stories260k_eagle_dir, capfd, stories260k):
    """`--repetition-penalty 1.3 --no-repeat-ngram-size 3`: the text `target.generate` writes with them, not the
    plain one."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    processed = target.generate(ids, max_new_tokens=30, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    expected = tokenizer.decode(processed[0], skip_special_tokens=True)
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "30", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "3"])
    assert code == 0
    out, _ = capfd.readouterr()
    assert out.strip() == expected.strip()
    plain = tokenizer.decode(target.generate(ids, max_new_tokens=30, do_sample=False)[0], skip_special_tokens=True)
    assert expected != plain  # the penalty changed the text


def test_generate_stop_strings_end_the_text_where_transformers_does(stories260k_eagle_dir, capfd, stories260k):
    """`--stop " Lily" --stop "zzz"`: the text ends right after the first stop string, as `target.generate`'s."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    stopped = target.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[" Lily", "zzz"],
                              tokenizer=tokenizer)
    expected = tokenizer.decode(stopped[0], skip_special_tokens=True)
    assert expected.endswith(" Lily") and stopped.shape[1] < ids.shape[1] + 40
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "40", "--stop", " Lily", "--stop", "zzz"])
    assert code == 0
    out, err = capfd.readouterr()
    assert out.strip() == expected.strip()
    assert f"{stopped.shape[1] - ids.shape[1]} tokens" in err


STORY_STARTS = ["Once upon a time", "The dog ran", "Lily and Tom", "A big red ball", "The sun", "Tim had a cat"]


def test_generate_prompts_file_answers_every_prompt_batched_and_resumes(stories260k_eagle_dir, stories260k, tmp_path,
                                                                        capfd):
    """`--prompts FILE --out F`: each answer is the target's greedy one (3 rows at a time, joining as others end, their
    prompts prefilled 2 tokens a round, a stop string ending some early); a second run with more prompts answers only
    the new ones."""
    target, tokenizer = stories260k
    prompts, out = tmp_path / "prompts.txt", tmp_path / "answers" / "out.jsonl"
    prompts.write_text("\n".join(STORY_STARTS[:4]) + "\n")
    base = ["generate", "--heads", str(stories260k_eagle_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "30", "--max-batch", "3", "--stop", " Lily", "--prefill-chunk", "2"]
    assert main(base) == 0
    assert "4 answers (0 already" in capfd.readouterr().err
    prompts.write_text("\n".join(STORY_STARTS) + "\n")
    assert main(base) == 0
    assert "2 answers (4 already" in capfd.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in records) == sorted(STORY_STARTS)
    for record in records:
        ids = tokenizer(record["prompt"], return_tensors="pt").input_ids
        expected = target.generate(ids, max_new_tokens=30, do_sample=False, stop_strings=[" Lily"], tokenizer=tokenizer)
        assert record["answer"] == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True), record
        assert record["new_tokens"] == expected.shape[1] - ids.shape[1] and record["tau"] >= 1
        assert record["finish_reason"] == ("length" if record["new_tokens"] == 30 else "stop")


def test_generate_prompts_writes_the_learned_corpus_every_k_answers(stories260k_eagle_dir, tmp_path, capfd,
                                                                     monkeypatch):
    """`--corpus-learned FILE --corpus-save-every 2` over 3 prompts: FILE is written after the 2nd answer learned
    (a kill -9 then would keep those two) and when the command ends."""
    from specheads.inference.corpus_lookup import CorpusLookup, read_corpus_file

    writes: list[int] = []
    save_learned = CorpusLookup.save_learned
    monkeypatch.setattr(CorpusLookup, "save_learned", lambda self, path: writes.append(len(self.recent))
                        or save_learned(self, path))
    prompts, learned = tmp_path / "prompts.txt", tmp_path / "learned.npy"
    prompts.write_text("\n".join(STORY_STARTS[:3]) + "\n")
    assert main(["generate", "--heads", str(stories260k_eagle_dir), "--prompts", str(prompts), "--out",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", "8", "--max-batch", "1", "--corpus-learn", "500",
                 "--corpus-learned", str(learned), "--corpus-save-every", "2"]) == 0
    capfd.readouterr()
    assert writes == [2, 3] and len(read_corpus_file(learned)) == 3


def test_generate_prompts_file_samples_the_same_answers_whatever_the_batch(stories260k_eagle_dir, tmp_path, capfd,
                                                                          monkeypatch):
    """--max-batch 1 and 4, and --batching off (one prompt at a time, as on CUDA by default): the same answers."""
    import specheads.inference.batch_file as batch_file

    engines = []
    real_engine_for = batch_file.engine_for
    monkeypatch.setattr(batch_file, "engine_for", lambda lm, batching: engines.append(batching) or real_engine_for(lm, batching))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(STORY_STARTS) + "\n")
    answers = {}
    for batch, batching in (("1", "auto"), ("4", "auto"), ("4", "off")):
        out = tmp_path / f"out{batch}{batching}.jsonl"
        assert main(["generate", "--heads", str(stories260k_eagle_dir), "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "20", "--max-batch", batch, "--do-sample", "--temperature", "1.0",
                     "--seed", "3", "--batching", batching]) == 0
        answers[batch + batching] = {r["id"]: r["answer"] for r in map(json.loads, out.read_text().splitlines())}
    assert answers["1auto"] == answers["4auto"] == answers["4off"] and engines == [None, None, False]
    assert len(set(answers["1auto"].values())) == len(STORY_STARTS)
    assert main(["generate", "--heads", str(stories260k_eagle_dir), "--prompts", str(prompts)]) == 2
    assert "needs --out" in capfd.readouterr().err


def test_generate_json_schema_writes_valid_json(stories260k_eagle_dir, capfd, tmp_path):
    """`--json-schema FILE`: the streamed text is JSON valid under the schema; a bad schema is one clear error."""
    pytest.importorskip("outlines_core")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
                                  "required": ["name"]}))
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                 "--max-new-tokens", "40", "--json-schema", str(schema)])
    assert code == 0
    out, _ = capfd.readouterr()
    value = json.loads(out.removeprefix("<s>").strip().removeprefix("Once upon a time").strip())
    assert list(value) == ["name"] and len(value["name"]) <= 10
    code = main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "x", "--json-schema", "{not json"])
    assert code == 2
    assert "--json-schema '{not json' is neither a file nor valid JSON" in capfd.readouterr().err


def test_generate_applies_the_chat_template_when_the_tokenizer_has_one(stories260k_eagle_dir, tmp_path, capfd):
    """Like `specheads bench`: a target whose tokenizer has a chat template gets the prompt inside it (a chat model
    fed raw text often ends at once); `--no-chat` feeds the raw text; stories260K has no template (tests above)."""
    import json
    import shutil

    from specheads.targets import ALIASES

    chat_target = tmp_path / "stories260K-chat"
    shutil.copytree(ALIASES["stories260k"], chat_target)
    config = json.loads((chat_target / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[Q] {{ m['content'] }}{% endfor %} [A]"
    (chat_target / "tokenizer_config.json").write_text(json.dumps(config))
    base = ["generate", "--target", str(chat_target), "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
            "--max-new-tokens", "8"]
    assert main(base) == 0
    assert capfd.readouterr().out.startswith("[Q] Once upon a time [A]")
    assert main([*base, "--no-chat"]) == 0
    assert capfd.readouterr().out.startswith("Once upon a time,")


def test_generate_streams_no_special_tokens(stories260k_eagle_dir, capfd):
    """The streamed text is the prompt and its continuation, without special tokens such as <s>."""
    out, _ = _generate(stories260k_eagle_dir, capfd)
    assert out.startswith("Once upon a time,")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_lookup_settings_fail_before_any_loading(tmp_path, capsys, command):
    """A growing guess without prompt lookup is refused by name, before the (missing) heads would be loaded."""
    missing = tmp_path / "no-such-heads"
    args = ["--prompt", "Once"] if command == "generate" else ["--prompts", str(tmp_path / "p.txt")]
    assert main([command, "--heads", str(missing), *args, "--lookup-max-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "lookup_max_tokens=8 must be None or an integer >= lookup_tokens=0" in err and "does not exist" not in err
    assert main([command, "--heads", str(missing), *args, "--lookup-corpus", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no lookup corpus at" in err and "specheads data lookup-corpus" in err and "does not exist" not in err
    assert main([command, "--heads", str(missing), *args, "--corpus-min-gain", "-0.5"]) == 2
    err = capsys.readouterr().err
    assert "--corpus-min-gain -0.5: expected a number >= 0" in err and "does not exist" not in err
    if command == "generate":  # bench keeps no learned corpus
        assert main([command, "--heads", str(missing), *args, "--corpus-save-every", "-1"]) == 2
        err = capsys.readouterr().err
        assert "--corpus-save-every -1: expected 0 (only at the end)" in err and "does not exist" not in err


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """A bad input through the CLI is one clear line on stderr and exit status 2, not a traceback."""
    monkeypatch.delenv("SPECHEADS_TRACEBACK", raising=False)
    missing = tmp_path / "no-such-heads"
    assert main(["generate", "--heads", str(missing), "--prompt", "Once"]) == 2
    err = capsys.readouterr().err
    assert f"specheads: error: heads checkpoint folder {str(missing)!r} does not exist" in err
    assert "Traceback" not in err
    monkeypatch.setenv("SPECHEADS_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        main(["generate", "--heads", str(missing), "--prompt", "Once"])


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_answers_each_line_reuses_the_cache_and_resets(stories260k_eagle_dir, stories260k, tmp_path, capfd,
                                                            monkeypatch):
    """`specheads chat`: one answer per stdin line, each the target's greedy answer to the conversation so far;
    the second turn reuses the first's cache; `/reset` starts over; end of input quits with status 0."""
    import io

    target, tokenizer = stories260k
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tom had a dog\n\nWhat did the dog do\n/reset\nTom had a dog\n"))
    code = main(["chat", "--heads", str(stories260k_eagle_dir), "--chat-template", str(template),
                 "--max-new-tokens", "20"])
    assert code == 0
    out, err = capfd.readouterr()

    def answer(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=CHAT_TEMPLATE,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        new = target.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
        return tokenizer.decode(new, skip_special_tokens=True)

    first = answer([{"role": "user", "content": "Tom had a dog"}])
    second = answer([{"role": "user", "content": "Tom had a dog"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "What did the dog do"}])
    assert out == f"{first}\n{second}\n{first}\n"  # the streamer ends each answer with a newline
    stats = [line for line in err.splitlines() if "tokens/s" in line]
    assert len(stats) == 3 and "(0 reused)" in stats[0] and "(0 reused)" not in stats[1] and "(0 reused)" in stats[2]
    assert "new conversation" in err


def test_chat_retry_answers_the_last_message_again_from_the_cache(stories260k_eagle_dir, stories260k, tmp_path,
                                                                   capfd, monkeypatch):
    """`/retry` (`ChatSession.regenerate`): the last answer is replaced by a new one to the same conversation (greedy:
    the same text), from the cache; before any answer it says so."""
    import io

    target, tokenizer = stories260k
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/retry\nTom had a dog\nWhat did the dog do\n/retry\n"))
    assert main(["chat", "--heads", str(stories260k_eagle_dir), "--chat-template", str(template),
                 "--max-new-tokens", "20"]) == 0
    out, err = capfd.readouterr()
    answers = out.splitlines()
    assert len(answers) == 3 and answers[1] == answers[2] and answers[0] != answers[1]
    assert "/retry: there is no answer to give again yet" in err
    reused = [int(line.split("(")[1].split(" reused")[0]) for line in err.splitlines() if "tokens/s" in line]
    # a Llama's cache is cropped anywhere: the retry reuses the whole conversation but the prompt's last token
    assert len(reused) == 3 and reused[2] > reused[1] > 0


def test_chat_without_a_template_is_a_clear_error(stories260k_eagle_dir, capsys, monkeypatch):
    import io

    monkeypatch.delenv("SPECHEADS_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--heads", str(stories260k_eagle_dir)]) == 2
    assert "has no chat template" in capsys.readouterr().err


def test_serve_answers_over_http_with_its_options_as_defaults(stories260k_eagle_dir, stories260k, tmp_path):
    """`specheads serve` as a user starts it: a process listening on the port, the model under its served name, the
    command line's decoding options as the defaults of a request that leaves them out, the node budget chosen per
    round (its verification cost measured at the start), the prompt prefilled 4 tokens a round; SIGTERM ends it
    cleanly, writing what the corpus lookup learned (the answer, not the warm-up's) to `--corpus-learned`."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    target, tokenizer = stories260k
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "specheads", "serve", "--heads", str(stories260k_eagle_dir), "--chat-template",
         str(template), "--port", str(port), "--served-model-name", "tiny", "--max-new-tokens", "12", "--quiet",
         "--max-round-nodes", "auto", "--prefill-chunk", "4", "--corpus-learn", "500", "--corpus-learned",
         str(tmp_path / "learned.npy"), "--tool-call-parser", "hermes", "--reasoning-parser", "think",
         "--responses-dir", str(tmp_path / "responses"), "--record", str(tmp_path / "traffic.jsonl")],
        stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items() if k != "SPECHEADS_API_KEY"},
        # a suite started in the background inherits SIGINT ignored, and Python keeps it so: Ctrl-C must reach it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):  # up to a minute to import and load
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                assert process.poll() is None, process.stderr.read()
                time.sleep(0.1)
        messages = [{"role": "user", "content": "Tom had a dog"}]
        request = urllib.request.Request(base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "messages": messages}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.loads(response.read())
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=CHAT_TEMPLATE,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        expected = tokenizer.decode(target.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:],
                                    skip_special_tokens=True)
        assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 12
        assert body["choices"][0]["message"]["content"] == expected
        request = urllib.request.Request(base + "/v1/responses", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tiny", "input": "Tom had a dog"}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            stored = json.loads(response.read())
        files = list((tmp_path / "responses").glob("*.json"))  # --responses-dir: kept on disk
        assert len(files) == 1 and json.loads(files[0].read_text())["response"]["id"] == stored["id"]
        recorded = [json.loads(line) for line in (tmp_path / "traffic.jsonl").read_text().splitlines()]  # --record
        assert [r["messages"][-1]["content"] for r in recorded] == [expected, stored["output"][0]["content"][0]["text"]]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    log = process.stderr.read()
    assert f"serving 'tiny' at http://127.0.0.1:{port}/v1" in log and "node budget auto, verification 1 tokens" in log
    assert "tool calls read as hermes; reasoning read as think" in log
    assert f"answers recorded to {tmp_path / 'traffic.jsonl'}" in log
    assert "(OpenAI API; tree 6,8,32,0,0;" in log  # the heads' default tree (no cpu_tree in their config)
    from specheads.inference.corpus_lookup import read_corpus_file

    learned = read_corpus_file(tmp_path / "learned.npy")  # the chat answer, then the /v1/responses one
    assert len(learned) == 2 and learned[0].tolist() == ids[0, -3:].tolist() + target.generate(
        ids, max_new_tokens=12, do_sample=False)[0, -12:].tolist()


def test_threads_option_sets_torch_threads_and_is_checked(stories260k_eagle_dir, capfd, tmp_path):
    """`--threads N` (generate, chat, serve) sets torch's CPU threads; 0 is refused by name before any loading."""
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", "--heads", str(stories260k_eagle_dir), "--prompt", "Once upon a time",
                     "--max-new-tokens", "4", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capfd.readouterr()
    assert main(["generate", "--heads", str(tmp_path / "missing"), "--prompt", "Once", "--threads", "0"]) == 2
    err = capfd.readouterr().err
    assert "--threads 0: expected a number of CPU threads >= 1" in err and "does not exist" not in err


def test_export_then_import_through_the_command_line(stories260k_eagle_dir, tmp_path, capsys):
    """`specheads export --format eagle` writes the EAGLE-1 layout, `specheads import` (format detected, target read
    from the folder or given) brings the same weights back; a bad export format is a usage error."""
    from safetensors.torch import load_file

    from specheads.heads.interop import detect_format

    exported = tmp_path / "eagle"
    assert main(["export", "--heads", str(stories260k_eagle_dir), "--format", "eagle", "--out", str(exported)]) == 0
    assert f"wrote {exported}" in capsys.readouterr().out and detect_format(exported) == "eagle"
    back = tmp_path / "back"
    assert main(["import", str(exported), "--target", "stories260K", "--out", str(back)]) == 0
    assert f"imported eagle heads into {back}" in capsys.readouterr().out
    ours, theirs = load_file(stories260k_eagle_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(SystemExit):
        main(["export", "--heads", str(stories260k_eagle_dir), "--format", "gguf", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
