"""`specheads bench`: a real run on stories260K (JSON, markdown, plots) and its greedy-identity policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specheads import SpeculativeLM, create_heads, load_target
from specheads.inference.bench import (
    aggregate,
    answer_lengths,
    bench_main,
    build_parser,
    run_batch,
    run_prompt,
)
from specheads.inference.bench_report import markdown_table
from specheads.inference.fast_path import StaticGreedyDecoder
from specheads.inference.prompts import Prompt, calibration_prompts, read_prompts


@pytest.fixture(scope="module")
def eagle_heads_dir(tmp_path_factory):
    target, _ = load_target("stories260K")
    folder = tmp_path_factory.mktemp("heads") / "eagle"
    create_heads(target, "eagle", tree_depth=3, tree_top_k=2, tree_num_nodes=4).save_pretrained(folder)
    return folder


def run_bench(tmp_path, heads_dir, prompt_lines: str, *options: str) -> tuple[dict, Path]:
    """`specheads bench` on stories260K over these prompt lines, 12 new tokens, 1 thread: (results, the JSON path)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt_lines)
    out = tmp_path / "bench" / "results.json"
    argv = ["--target", "stories260K", "--heads", str(heads_dir), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--threads", "1", "--out", str(out), *options]
    assert bench_main(argv) == 0
    return json.loads(out.read_text()), out


def test_bench_writes_json_table_and_plots(tmp_path, eagle_heads_dir):
    results, out = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n",
                             "--modes", "greedy,sample", "--prompt-lookup", "2")
    assert results["greedy_identical"] is True
    assert results["environment"]["dtype"] == "float32"
    assert results["environment"]["graphed_prefill"] == "auto"  # the default: padded on CUDA, eager here
    assert {r["mode"] for r in results["per_prompt"]} == {"greedy", "sample"}
    for mode in ("greedy", "sample"):
        overall = results[mode]["overall"]
        assert overall["tau"] >= 1.0 and overall["speedup"] > 0
    greedy_rows = [r for r in results["per_prompt"] if r["mode"] == "greedy"]
    assert all(r["tokens"] == 12 and r["prompt_lookup_tokens_per_second"] > 0 for r in greedy_rows)
    assert (out.parent / "results.md").is_file()
    assert sorted(p.suffix for p in out.parent.glob("*.png")) == [".png", ".png"]


def test_bench_with_lookup_and_tree_auto_records_both(tmp_path, eagle_heads_dir):
    """--lookup-tokens stays on through --tree auto's trials and is recorded with the chosen tree."""
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Tom had a red ball. Tom had a red ball. Tom had a\nThe cat sat\n",
                           "--prompt-lookup", "0", "--tree", "auto", "--lookup-tokens", "6")
    assert results["greedy_identical"] is True
    assert results["tree"]["lookup_tokens"] == 6
    assert all(trial["tree"]["lookup_tokens"] == 6 for trial in results["tree_autotune"]["trials"])
    # tuned on both prompts (fewer than the 8 calibration prompts it takes) at the benchmark's length
    assert results["tree_autotune"]["calibration_prompts"] == 2
    assert results["tree_autotune"]["calibration_max_new_tokens"] == 12


def test_bench_saves_heads_with_the_tree_it_chose(tmp_path, eagle_heads_dir):
    """--tree auto --save-tree DIR: a copy of the heads whose default tree is the chosen one (generate uses it)."""
    from specheads import SpeculativeLM

    tuned = tmp_path / "tuned"
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n", "--prompt-lookup", "0",
                           "--tree", "auto", "--save-tree", str(tuned))
    reloaded = SpeculativeLM.from_pretrained("stories260K", tuned).tree_description()
    assert reloaded == results["tree"]  # lookup off in both
    original = json.loads((eagle_heads_dir / "config.json").read_text())
    saved = json.loads((tuned / "config.json").read_text())
    # chosen on a CPU: the CPU's default (cpu_tree) changed, nothing else (other devices keep the tree_* fields)
    assert {k: v for k, v in saved.items() if k != "cpu_tree"} == {k: v for k, v in original.items() if k != "cpu_tree"}
    tree = results["tree"]
    assert saved["cpu_tree"] == {"tree_depth": tree["depth"], "tree_top_k": tree["top_k"], "tree_num_nodes":
                                 tree["nodes"], "tree_stop_prob": tree["stop_prob"], "tree_min_prob": tree["min_prob"]}
    assert (tuned / "model.safetensors").read_bytes() == (eagle_heads_dir / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit):
        bench_main(["--heads", str(eagle_heads_dir), "--prompts", "x.txt", "--save-tree", str(tmp_path / "no")])


def test_bench_with_a_lookup_corpus_records_it_and_stays_identical(tmp_path, eagle_heads_dir):
    """--lookup-corpus: a corpus of the target's answers to other prompts; greedy runs identical, the corpus in the
    recorded tree."""
    from specheads.inference.corpus_lookup import CorpusLookup

    target, tokenizer = load_target("stories260K")
    other = tokenizer("Lily went to the park", return_tensors="pt").input_ids
    answer = target.generate(other, max_new_tokens=40, do_sample=False)[0, other.shape[1]:].tolist()
    CorpusLookup([answer]).save(tmp_path)
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n", "--prompt-lookup", "0",
                           "--lookup-corpus", str(tmp_path), "--corpus-tokens", "5")
    assert results["greedy_identical"] is True
    assert results["tree"]["corpus_tokens"] == 5 and results["tree"]["corpus_size"] == 40


def test_bench_under_a_json_schema_constrains_every_run(tmp_path, eagle_heads_dir):
    """--json-schema: the baseline, the speculative run and transformers' prompt lookup all generate under it (each
    call a fresh processor over one compiled index); greedy stays identical, the schema is recorded; a bad schema
    is a clear error."""
    pytest.importorskip("outlines_core")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                  "required": ["name"]}))
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n", "--json-schema", str(schema),
                           "--prompt-lookup", "3", "--max-new-tokens", "24")
    assert results["greedy_identical"] is True and results["constraint"]["json_schema"] == str(schema)
    assert all(r["prompt_lookup_tokens_per_second"] > 0 for r in results["per_prompt"])
    target, tokenizer = load_target("stories260K")
    ids = tokenizer("The cat sat", return_tensors="pt").input_ids
    from specheads.inference.constraints import constraint_from_options

    constrained = target.generate(ids, max_new_tokens=24, do_sample=False,
                                  logits_processor=[constraint_from_options(tokenizer, str(schema))])
    text = tokenizer.decode(constrained[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.lstrip().startswith("{")  # what the bench compared against is constrained output
    assert [r["tokens"] for r in results["per_prompt"]][1] == constrained.shape[1] - ids.shape[1]
    with pytest.raises(ValueError, match="is neither a file nor valid JSON"):
        run_bench(tmp_path, eagle_heads_dir, "x\n", "--json-schema", "{oops")


def test_bench_under_any_json_object_needs_no_outlines(tmp_path, eagle_heads_dir):
    """--json-schema '{"type": "object"}': every run under the JSON-object constraint (inference/json_object.py),
    greedy identical, the answers JSON."""
    from specheads.inference.json_object import START, advance

    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n", "--json-schema",
                           '{"type": "object"}', "--prompt-lookup", "3", "--max-new-tokens", "24")
    assert results["greedy_identical"] is True and results["constraint"]["json_schema"] == '{"type": "object"}'
    target, tokenizer = load_target("stories260K")
    ids = tokenizer("The cat sat", return_tensors="pt").input_ids
    from specheads.inference.json_object import json_object_constraint

    constrained = target.generate(ids, max_new_tokens=24, do_sample=False,
                                  logits_processor=[json_object_constraint(tokenizer)])
    assert advance(START, tokenizer.decode(constrained[0, ids.shape[1]:], skip_special_tokens=True)) is not None
    assert [r["tokens"] for r in results["per_prompt"]][1] == constrained.shape[1] - ids.shape[1]


def test_bench_times_transformers_assisted_generation_as_a_peer(tmp_path, eagle_heads_dir):
    """--assistant: transformers `generate(assistant_model=...)` timed on each greedy prompt beside the baseline, its
    speedup in the JSON and the table (the target as its own draft model: a valid, if pointless, pair)."""
    results, out = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat\n", "--assistant", "stories260K")
    assert results["greedy_identical"] is True
    assert all(r["assisted_tokens_per_second"] > 0 for r in results["per_prompt"])
    overall = results["greedy"]["overall"]
    assert overall["assisted_speedup"] == pytest.approx(
        overall["assisted_tokens_per_second"] / overall["baseline_tokens_per_second"])
    assert "| assisted speedup |" in (out.parent / "results.md").read_text()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--turns", "0"), "--turns 0: expected at least 1"),
        (("--turns", "2"), "--turns 2 needs the target's chat template .* the tokenizer has none"),
        (("--batch-size", "0"), "--batch-size 0: expected at least 1"),
        (("--batch-size", "2", "--json-schema", '{"type": "string"}'), "--batch-size 2 runs first turns without "
                                                                         "constraints"),
        (("--modes", "greedy,beam"), r"--modes \['beam'\] unknown; expected greedy and/or sample"),
    ],
)
def test_bench_options_that_cannot_run_are_named(tmp_path, eagle_heads_dir, options, message):
    with pytest.raises(ValueError, match=message):
        run_bench(tmp_path, eagle_heads_dir, "Once upon a time\n", *options)


class _CorruptingLM:
    """A SpeculativeLM stand-in whose greedy output differs from the target's at the third new token."""

    def __init__(self, lm: SpeculativeLM) -> None:
        self.lm, self.target, self.last_stats = lm, lm.target, {}

    def generate(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.lm.generate(ids, **kwargs)
        self.last_stats = self.lm.last_stats
        out[0, ids.shape[1] + 2] = (out[0, ids.shape[1] + 2] + 1) % self.target.config.vocab_size
        return out


def test_bench_batch_size_runs_batches_against_plain_batched_generate(tmp_path, eagle_heads_dir):
    lines = "Once upon a time\nThe cat sat\nLily and Tom went to the park to play\nThe dog\nA big red ball\n"
    results, _ = run_bench(tmp_path, eagle_heads_dir, lines, "--batch-size", "2", "--modes", "greedy,sample")
    assert results["batch_size"] == 2 and results["greedy_identical"] is True
    greedy = [r for r in results["per_prompt"] if r["mode"] == "greedy"]
    assert [r["batch_size"] for r in greedy] == [2, 2, 1]  # five prompts: two batches of 2, then one
    assert all(r["tokens"] == r["baseline_tokens"] for r in greedy)  # the same answers
    assert sum(r["tokens"] for r in greedy) == results["greedy"]["overall"]["tokens"] > 0
    assert results["sample"]["overall"]["tau"] >= 1.0


def test_bench_batch_size_with_an_automatic_node_budget(tmp_path, eagle_heads_dir):
    lines = "Once upon a time\nThe cat sat\nLily and Tom went to the park to play\nThe dog\n"
    results, _ = run_bench(tmp_path, eagle_heads_dir, lines, "--batch-size", "2", "--max-round-nodes", "auto")
    assert results["max_round_nodes"] == "auto" and results["greedy_identical"] is True
    assert sorted(map(int, results["verification_ms_by_tokens"])) == [1, 2, 4, 8, 16, 32, 64, 128]
    for row in results["per_prompt"]:  # each batch's rounds by the size chosen
        assert sum(row["rounds_by_nodes_per_row"].values()) == row["rounds"]
        assert row["tokens"] == row["baseline_tokens"]
    assert results["per_prompt"][0]["rounds_by_nodes_per_row"].get("full", 0) >= 1  # nothing measured yet: full
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--heads", "x", "--prompts", "x", "--max-round-nodes", "0"])


def test_a_batched_greedy_difference_fails_the_bench(eagle_heads_dir):
    lm = SpeculativeLM.from_pretrained("stories260K", eagle_heads_dir)
    args = build_parser().parse_args(["--heads", "x", "--prompts", "x", "--max-new-tokens", "8"])
    prompts = [Prompt(f"p{i}", "text", text, lm.tokenizer(text, return_tensors="pt").input_ids)
               for i, text in enumerate(["Once upon a time", "The cat sat on the mat"])]
    assert run_batch(lm, prompts, "greedy", args)["identical_to_plain_batch"] == 2
    with pytest.raises(RuntimeError, match="prompt p0 in a batch of 2"):
        run_batch(_CorruptingLM(lm), prompts, "greedy", args)
    assert answer_lengths(torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]]), {2}) == [2, 4]


def test_bench_graphed_prefill_is_recorded_and_exact(tmp_path, eagle_heads_dir):
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\nThe cat sat on the mat and looked\n",
                           "--modes", "greedy", "--prompt-lookup", "0", "--fast-path", "on", "--graphed-prefill", "on")
    assert results["greedy_identical"] is True and results["environment"]["graphed_prefill"] == "on"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_difference_fails_in_float32_and_is_recorded_in_16_bit(eagle_heads_dir, dtype):
    lm = SpeculativeLM.from_pretrained("stories260K", eagle_heads_dir, dtype=dtype)
    ids = lm.tokenizer("Once upon a time", return_tensors="pt").input_ids
    args = build_parser().parse_args(["--heads", "x", "--prompts", "x", "--max-new-tokens", "8", "--prompt-lookup", "0"])
    prompt = Prompt("p1", "text", "Once upon a time", ids)
    assert run_prompt(lm, prompt, "greedy", args, None)["greedy_identical"] is True  # the real engine is exact
    if dtype == torch.float32:
        with pytest.raises(RuntimeError, match="prompt p1 at new token 2"):
            run_prompt(_CorruptingLM(lm), prompt, "greedy", args, None)
    else:
        with pytest.warns(UserWarning, match="new token 2"):
            row = run_prompt(_CorruptingLM(lm), prompt, "greedy", args, None)
        assert row["greedy_identical"] is False and row["first_difference"] == 2


def test_our_static_plain_decoding_is_timed_beside_generate_with_its_prefill(eagle_heads_dir):
    """The CUDA bench's honest baseline (`StaticGreedyDecoder`), run here on the CPU without graphs: identical to
    `generate`, and its prompt forward timed apart (as the speculative path's `prefill_seconds`)."""
    lm = SpeculativeLM.from_pretrained("stories260K", eagle_heads_dir)
    ids = lm.tokenizer("Once upon a time", return_tensors="pt").input_ids
    args = build_parser().parse_args(["--heads", "x", "--prompts", "x", "--max-new-tokens", "12", "--prompt-lookup", "0"])
    decoder = StaticGreedyDecoder(lm.target, capacity=64)
    row = run_prompt(lm, Prompt("p1", "text", "Once upon a time", ids), "greedy", args, None, decoder)
    assert row["static_identical"] is True and row["greedy_identical"] is True
    assert row["static_baseline_tokens"] == row["baseline_tokens"]
    assert 0 < row["static_baseline_prefill_seconds"] < row["static_baseline_seconds"]
    # our plain decoding before the speculative run (every other prompt in the bench): the same record
    first = run_prompt(lm, Prompt("p1", "text", "Once upon a time", ids), "greedy", args, None, decoder, static_first=True)
    assert first["static_identical"] is True and first["static_baseline_tokens"] == row["static_baseline_tokens"]
    assert 0 < first["static_baseline_prefill_seconds"] < first["static_baseline_seconds"]
    totals = aggregate([row, row])
    assert totals["static_baseline_prefill_seconds"] == pytest.approx(2 * row["static_baseline_prefill_seconds"])
    assert totals["speedup_vs_static"] == pytest.approx(row["speedup_vs_static"])
    # the markdown table gets our plain decoding's columns (the CUDA bench's honest baseline)
    results = {"target": "t", "head_type": "eagle", "tree": "x", "max_new_tokens": 12,
               "environment": {"device": "cpu", "dtype": "float32", "threads": 1},
               "greedy": {"overall": totals, "by_category": {"text": totals}}}
    table = markdown_table(results)
    assert "| our plain decoding tokens/s | speedup vs it |" in table
    assert f"| {totals['static_baseline_tokens_per_second']:.1f} | {totals['speedup_vs_static']:.2f}x |" in table


def test_prompts_per_category_keeps_the_first_of_each(tmp_path):
    lines = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aabbbcab")]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    picked = read_prompts(path, per_category=2)
    assert [r["prompt_id"] for r in picked] == ["0", "1", "2", "3", "5"]
    assert [r["prompt_id"] for r in read_prompts(path, categories=["b"], per_category=1)] == ["2"]
    assert len(read_prompts(path, per_category=2, limit=3)) == 3
    with pytest.raises(ValueError, match="per_category=0"):
        read_prompts(path, per_category=0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"turns": ["a"],', r"q\.jsonl:2 is not valid JSON"),
        ('["a", "b"]', r"q\.jsonl:2 is a JSON list; expected an object with 'turns', 'prompt' or 'text'"),
        ('{"turns": []}', r"q\.jsonl:2 has turns=\[\]; expected a non-empty list of strings"),
        ('{"turns": "hello"}', r"q\.jsonl:2 has turns='hello'; expected a non-empty list of strings"),
        ('{"question_id": 7}', r"q\.jsonl:2 has no 'turns', 'prompt' or 'text' field holding text"),
        ('{"prompt": 42}', r"q\.jsonl:2 has no 'turns', 'prompt' or 'text' field holding text"),
    ],
)
def test_a_bad_prompt_line_is_named_with_its_line_number(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": ["fine"]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_prompts(path)


def test_unknown_categories_and_a_missing_file_are_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "math", "prompt": "2 + 2?"}) + "\n")
    assert read_prompts(path)[0]["turns"] == ["2 + 2?"]
    with pytest.raises(ValueError, match=r"categories \['poetry'\] not in .*q\.jsonl; known: \['math'\]"):
        read_prompts(path, categories=["math", "poetry"])
    with pytest.raises(FileNotFoundError, match="prompts file .*nope.jsonl does not exist"):
        read_prompts(tmp_path / "nope.jsonl")


def test_prompts_from_any_data_source(tmp_path, offline_hub_cache):
    """Parquet conversations (their user turns), records whose `prompt` is a list of turns (the Hub's MT-bench
    prompts), and a Hub dataset id[:split] from the offline cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [{"id": "c1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]},
             {"conversations": [{"from": "human", "value": "Name a fruit."}, {"from": "gpt", "value": "Apple."}]}]
    pq.write_table(pa.Table.from_pylist([chats[0]]), tmp_path / "chats.parquet")
    rows = read_prompts(tmp_path / "chats.parquet")
    assert rows == [{"prompt_id": "c1", "category": "default", "text": "Hi?", "turns": ["Hi?", "Bye?"]}]
    (tmp_path / "sharegpt.json").write_text(json.dumps(chats[1:]))
    assert read_prompts(tmp_path / "sharegpt.json")[0]["turns"] == ["Name a fruit."]
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    mt_bench = [{"prompt_id": 81 + i, "category": c, "prompt": [f"Write {i}.", f"Now shorter {i}."]}
                for i, c in enumerate(["writing", "math", "writing"])]
    pq.write_table(pa.Table.from_pylist(mt_bench), repo / "train-00000-of-00001.parquet")
    offline_hub_cache.publish(repo.parent, "test-org/mt-bench", repo_type="dataset")
    rows = read_prompts("test-org/mt-bench:train", categories=["writing"])
    assert [(r["prompt_id"], r["turns"]) for r in rows] == [("81", ["Write 0.", "Now shorter 0."]),
                                                            ("83", ["Write 2.", "Now shorter 2."])]
    (tmp_path / "bad.json").write_text(json.dumps([{"messages": [{"role": "assistant", "content": "only me"}]}]))
    with pytest.raises(ValueError, match=r"bad\.json record 0 has no .*nor a conversation with a user turn"):
        read_prompts(tmp_path / "bad.json")


def test_calibration_prompts_spread_over_categories_first():
    prompts = [Prompt(str(i), c, f"q{i}", torch.tensor([[i]])) for i, c in enumerate("aabbbcab")]
    assert [p.prompt_id for p in calibration_prompts(prompts)] == ["0", "2", "5", "1"]
    assert [p.prompt_id for p in calibration_prompts(prompts, count=2)] == ["0", "2"]
    assert [p.prompt_id for p in calibration_prompts(prompts[:2], count=4)] == ["0", "1"]
    with pytest.raises(ValueError, match="count=0"):
        calibration_prompts(prompts, count=0)


def test_eagle_tree_specs_parse_with_optional_probabilities():
    from specheads.inference.tree import parse_eagle_tree

    # left out, the probabilities are 0 (no pruning), whatever the heads' default pruning is
    assert parse_eagle_tree("5,8,24") == {"tree_depth": 5, "tree_top_k": 8, "tree_num_nodes": 24, "tree_stop_prob": 0.0,
                                          "tree_min_prob": 0.0}
    assert parse_eagle_tree("6,6,16,0.05") == {"tree_depth": 6, "tree_top_k": 6, "tree_num_nodes": 16,
                                               "tree_stop_prob": 0.05, "tree_min_prob": 0.0}
    assert parse_eagle_tree("6,6,16,0,0.03")["tree_min_prob"] == 0.03
    for bad in ("5,8", "5,8,24,0.1,0.1,0.1", "5,x,24", "5,8,24,high"):
        with pytest.raises(ValueError, match=rf"--tree '{bad}': expected depth,top_k,nodes\[,stop_prob\[,min_prob\]\]"):
            parse_eagle_tree(bad)


def test_tree_sweep_runs_several_heads_side_by_side_on_one_target(tmp_path, eagle_heads_dir, monkeypatch):
    """scripts/tree_sweep.py --heads A,B: each heads folder is loaded onto the ONE target and runs every prompt."""
    import runpy
    import sys

    import specheads.heads.loading as loading

    target, _ = load_target("stories260K")
    torch.manual_seed(1)
    other = tmp_path / "other_heads"
    create_heads(target, "eagle", tree_depth=3, tree_top_k=2, tree_num_nodes=4).save_pretrained(other)
    loaded = []
    real_load_heads = loading.load_heads

    def spy(path, *args, **kwargs):
        loaded.append((str(path), kwargs.get("target")))
        return real_load_heads(path, *args, **kwargs)

    monkeypatch.setattr(loading, "load_heads", spy)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "sweep.json"
    script = Path(__file__).parents[2] / "scripts" / "tree_sweep.py"
    monkeypatch.setattr(sys, "argv", [
        str(script), "--target", "stories260K", "--heads", f"{eagle_heads_dir},{other}", "--prompts", str(prompts),
        "--per-category", "2", "--max-new-tokens", "10", "--threads", "1", "--cpu-linear", "default",
        "--cpu-attention", "default", "--out", str(out), "3,2,4",
    ])
    runpy.run_path(str(script), run_name="__main__")
    results = json.loads(out.read_text())["trees"]
    assert set(results) == {f"3,2,4 (heads {eagle_heads_dir})", f"3,2,4 (heads {other})"}
    assert all(r["prompts"] == 2 and r["greedy_identical"] for r in results.values())
    # the second heads were loaded onto the first one's target (the first come with SpeculativeLM.from_pretrained)
    second = [target_seen for path, target_seen in loaded if path == str(other)]
    assert len(second) == 1 and second[0] is not None


def test_gpu_tree_sweep_runs_trees_and_prefills_against_our_plain_decoding(tmp_path, eagle_heads_dir, monkeypatch):
    """scripts/gpu_tree_sweep.py on the CPU (its smoke test): every tree x graphed-prefill variant runs every prompt
    against our plain decoding with the same prefill, identical in float32."""
    import runpy
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "sweep.json"
    script = Path(__file__).parents[2] / "scripts" / "gpu_tree_sweep.py"
    monkeypatch.setattr(sys, "argv", [
        str(script), "--device", "cpu", "--target", "stories260K", "--heads", str(eagle_heads_dir), "--prompts",
        str(prompts), "--per-category", "2", "--max-new-tokens", "10", "--graphed-prefill", "auto,on",
        "--out", str(out), "3,2,4", "2,2,3",
    ])
    runpy.run_path(str(script), run_name="__main__")
    results = json.loads(out.read_text())
    assert set(results["variants"]) == {f"{tree} prefill {p}" for tree in ("3,2,4", "2,2,3") for p in ("auto", "on")}
    for variant in results["variants"].values():
        assert variant["prompts"] == 2 and variant["identical"] == 2 and variant["tau"] >= 1
        assert variant["speedup_vs_static"] > 0
    assert set(results["plain"]) == {"auto", "on"} and results["environment"]["dtype"] == "float32"
    other = tmp_path / "other_heads"  # --heads A,B: both on the one target, side by side
    target, _ = load_target("stories260K")
    torch.manual_seed(1)
    create_heads(target, "eagle", tree_depth=3, tree_top_k=2, tree_num_nodes=4).save_pretrained(other)
    monkeypatch.setattr(sys, "argv", [
        str(script), "--device", "cpu", "--target", "stories260K", "--heads", f"{eagle_heads_dir},{other}",
        "--prompts", str(prompts), "--max-new-tokens", "8", "--out", str(out), "3,2,4",
    ])
    runpy.run_path(str(script), run_name="__main__")
    results = json.loads(out.read_text())["variants"]
    assert set(results) == {f"3,2,4 prefill auto (heads {h})" for h in (eagle_heads_dir, other)}
    assert all(r["prompts"] == 2 and r["identical"] == 2 for r in results.values())
    monkeypatch.setattr(sys, "argv", [str(script), "--graphed-prefill", "sometimes", "3,2,4"])
    with pytest.raises(SystemExit, match="--graphed-prefill 'sometimes': expected a comma list of"):
        runpy.run_path(str(script), run_name="__main__")


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def test_bench_turns_run_later_turns_over_the_earlier_answers(tmp_path, eagle_heads_dir):
    """--turns 2: each two-turn record runs turn 1, then turn 2 = the chat template over turn 1, plain generate's
    answer to it and turn 2 (a one-turn record runs its one turn); every run identical; reported by turn."""
    import shutil

    from specheads.targets import ALIASES

    chat_target = tmp_path / "stories260K-chat"
    shutil.copytree(ALIASES["stories260k"], chat_target)
    config = json.loads((chat_target / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (chat_target / "tokenizer_config.json").write_text(json.dumps(config))
    records = [{"question_id": 1, "category": "story", "turns": ["Tom had a ball", "Where did it go"]},
               {"question_id": 2, "category": "story", "turns": ["Lily saw a cat"]}]
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "bench" / "results.json"
    argv = ["--target", str(chat_target), "--heads", str(eagle_heads_dir), "--prompts", str(prompts),
            "--max-new-tokens", "10", "--threads", "1", "--prompt-lookup", "0", "--turns", "2", "--out", str(out)]
    assert bench_main(argv) == 0
    results = json.loads(out.read_text())
    rows = results["per_prompt"]
    assert [(r["prompt_id"], r["turn"]) for r in rows] == [("1", 1), ("1", 2), ("2", 1)]
    assert all(r["greedy_identical"] for r in rows) and results["turns"] == 2
    assert results["greedy"]["by_turn"]["2"]["prompts"] == 1 and results["greedy"]["by_turn"]["1"]["prompts"] == 2
    assert "| turn 2 | 1 |" in out.with_suffix(".md").read_text()

    # turn 2's prompt is the template over turn 1, plain generate's answer and turn 2
    target, tokenizer = load_target(str(chat_target))
    first = tokenizer.apply_chat_template([{"role": "user", "content": "Tom had a ball"}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    answer = tokenizer.decode(target.generate(first, max_new_tokens=10, do_sample=False)[0, first.shape[1]:],
                              skip_special_tokens=True)
    second = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom had a ball"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "Where did it go"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True)["input_ids"]
    assert rows[1]["prompt_tokens"] == second.shape[1] and rows[0]["prompt_tokens"] == first.shape[1]

    with pytest.raises(ValueError, match="needs the target's chat template"):
        bench_main([*argv, "--no-chat"])


def test_bench_records_the_chat_template_keywords(tmp_path, eagle_heads_dir):
    results, _ = run_bench(tmp_path, eagle_heads_dir, "Once upon a time\n", "--modes", "greedy",
                           "--chat-template-kwargs", '{"enable_thinking": false}')
    assert results["chat_template_kwargs"] == {"enable_thinking": False} and results["greedy_identical"] is True
