"""`specheads demo`: on the embedded stories260K target, data -> features -> train -> benchmark, in minutes on a CPU.

1. The target writes its own training stories (batched sampling from short seed openings).
2. Its features of every story are dumped once (`specheads data dump-features`): the heads read them for ~9 epochs,
   and reading a dump costs less than running the target inside every step (2 CPU threads: 1.2 -> 0.83 s a step,
   the same metrics; session 49).
3. EAGLE heads train on them (the same loop as `specheads train`, `feature_mode=offline`).
4. Benchmark in the same run: for each prompt, plain greedy `target.generate` and speculative
   `SpeculativeLM.generate` alternate; the outputs must be identical.

Writes DIR/heads/ (a Hub-ready checkpoint), DIR/results.json, and prints a small table; DIR/features/ (the dump,
137 MiB) can be deleted afterwards.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from specheads.training.config import RunConfig, build_dataclass
from specheads.training.data_cli import STORY_SEEDS, regenerate

# (full run, quick smoke test)
DEMO_SETTINGS: dict[bool, dict[str, Any]] = {
    False: {"stories": 2048, "story_tokens": 256, "gen_batch": 128, "feature_batch": 32, "max_steps": 600, "global_batch_size": 32,
            "micro_batch_size": 32, "bench_prompts": 8, "bench_tokens": 160},
    True: {"stories": 48, "story_tokens": 48, "gen_batch": 48, "feature_batch": 8, "max_steps": 12, "global_batch_size": 8,
           "micro_batch_size": 8, "bench_prompts": 2, "bench_tokens": 24},
}


def demo_train_config(out: Path, data_file: Path, settings: dict[str, Any], features_dir: Path | None = None) -> RunConfig:
    """The run config the demo trains with (an EAGLE head; see configs/train/eagle_stories260k.yaml), on the dumped
    features in `features_dir` (None: the target runs inside every step)."""
    raw = {
        "output_dir": str(out / "train"),
        "target": "stories260K",
        "feature_mode": "online" if features_dir is None else "offline",
        "max_steps": settings["max_steps"],
        "save_steps": settings["max_steps"],
        "save_total_limit": 1,
        "seed": 0,
        "global_batch_size": settings["global_batch_size"],
        "micro_batch_size": settings["micro_batch_size"],
        "head": {"type": "eagle", "options": {}},
        "data": {"source": str(data_file), "format": "text", "max_length": demo_max_length(settings),
                 "features_dir": None if features_dir is None else str(features_dir)},
        # measured on stories260K: lr 1e-2 and token_weight 1.0 learn 1.6x faster than EAGLE's 3e-3 / 0.1
        "optim": {"learning_rate": 1e-2, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.05,
                  "max_grad_norm": 0.5},
        "loss": {"feature_weight": 1.0, "token_weight": 1.0, "input_noise": 0.1, "eval_depth": 3,
                 "train_depth": 3},  # unrolled depths: depth 2 lifted tau from 3.9 to 4.4 in a 300-step test
    }
    config = build_dataclass(RunConfig, raw)
    config.validate()
    return config


def demo_max_length(settings: dict[str, Any]) -> int:
    """Tokens per training example: a story and its opening."""
    return settings["story_tokens"] + 16


def dump_demo_features(target: Any, tokenizer: Any, data_file: Path, out: Path, settings: dict[str, Any]) -> Path:
    """The target's final-layer features of every story, dumped once into out/features (resumed if interrupted,
    verified and kept on a re-run)."""
    from specheads.training.data import build_dataset
    from specheads.training.features import dump_features

    features_dir = out / "features"
    dataset = build_dataset(str(data_file), tokenizer, "text", demo_max_length(settings))
    dump_features(target, dataset, features_dir, target.config.num_hidden_layers, batch_size=settings["feature_batch"],
                  pad_token_id=tokenizer.pad_token_id or 0)
    return features_dir


def benchmark(target: Any, heads: Any, tokenizer: Any, num_prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """Alternate plain greedy decoding and speculative decoding per prompt; check the outputs are identical.

    Returns:
        tau (new tokens per target forward, over all prompts), tokens_per_second, baseline_tokens_per_second,
        speedup, greedy_identical, and per-prompt rows.
    """
    from specheads.inference.generate import SpeculativeLM

    lm = SpeculativeLM(target, heads, tokenizer=tokenizer)
    eos = tokenizer.eos_token_id
    prompts = [tokenizer(STORY_SEEDS[i % len(STORY_SEEDS)], return_tensors="pt").input_ids for i in range(num_prompts)]
    warm = prompts[0]  # one untimed pass of each, so neither side pays first-call costs
    target.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=8, pad_token_id=eos)
    lm.generate(warm, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    rows, identical = [], True
    base_tokens = base_seconds = spec_tokens = spec_seconds = forwards = 0.0
    for ids in prompts:
        start = time.perf_counter()
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=eos)
        plain_seconds = time.perf_counter() - start
        spec = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
        stats = lm.last_stats
        same = plain.shape == spec.shape and bool(torch.equal(plain, spec))
        identical &= same
        base_tokens += plain.shape[1] - ids.shape[1]
        base_seconds += plain_seconds
        spec_tokens += stats["new_tokens"]
        spec_seconds += stats["seconds"]
        forwards += stats["target_forwards"]
        rows.append({"prompt": tokenizer.decode(ids[0], skip_special_tokens=True), "new_tokens": stats["new_tokens"],
                     "tau": round(stats["mean_accepted"], 3), "identical": same})
    tps, base_tps = spec_tokens / spec_seconds, base_tokens / base_seconds
    return {
        "tau": round(spec_tokens / max(forwards, 1), 3),
        "tokens_per_second": round(tps, 1),
        "baseline_tokens_per_second": round(base_tps, 1),
        "speedup": round(tps / base_tps, 3),
        "greedy_identical": identical,
        "tree": lm.tree_description(),
        "prompts": rows,
    }


def print_table(results: dict[str, Any]) -> None:
    """A small human-readable summary."""
    lines = [
        f"{'decoding':<22}{'tokens/s':>10}{'tau':>8}",
        f"{'plain greedy':<22}{results['baseline_tokens_per_second']:>10.1f}{1.0:>8.2f}",
        f"{'EAGLE speculative':<22}{results['tokens_per_second']:>10.1f}{results['tau']:>8.2f}",
        f"speedup {results['speedup']:.2f}x, outputs identical: {results['greedy_identical']}, "
        f"data {results['data_seconds']:.0f}s, features {results['features_seconds']:.0f}s, "
        f"training {results['training_seconds']:.0f}s, "
        f"total {results['total_seconds']:.0f}s",
    ]
    print("\n".join(lines))


def run_demo(out_dir: str, quick: bool = False) -> dict[str, Any]:
    """Data -> features -> train -> benchmark on stories260K. Re-running resumes (data, features and training are
    resumable).

    Args:
        out_dir: output folder; gets data/, features/, train/, heads/ and results.json.
        quick: a much smaller run (under a minute) for smoke tests.

    Returns:
        The results (also written to out_dir/results.json).
    """
    from specheads import load_heads, load_target
    from specheads.training.train import train

    settings = DEMO_SETTINGS[quick]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(0)
    target, tokenizer = load_target("stories260K")

    # 1. the target writes its own stories
    data_file = out / "data" / "stories.jsonl"
    regenerate(target, tokenizer, data_file, stories=settings["stories"], max_new_tokens=settings["story_tokens"],
               batch_size=settings["gen_batch"], temperature=1.0, seed=0)
    data_seconds = time.perf_counter() - started

    # 2. the target's features of the stories, once
    features_start = time.perf_counter()
    features_dir = dump_demo_features(target, tokenizer, data_file, out, settings)
    features_seconds = time.perf_counter() - features_start

    # 3. EAGLE heads train on them
    config = demo_train_config(out, data_file, settings, features_dir)
    train_start = time.perf_counter()
    metrics = train(config)
    training_seconds = time.perf_counter() - train_start
    heads_dir = out / "heads"
    shutil.rmtree(heads_dir, ignore_errors=True)
    shutil.copytree(Path(config.output_dir) / "final", heads_dir)

    # 4. benchmark against plain greedy decoding of the same target
    heads = load_heads(heads_dir, target=target)
    bench = benchmark(target, heads, tokenizer, settings["bench_prompts"], settings["bench_tokens"])
    results = {
        "target": "stories260K",
        "head_type": "eagle",
        "quick": quick,
        **{k: bench[k] for k in ("tau", "speedup", "tokens_per_second", "baseline_tokens_per_second", "greedy_identical")},
        "training_seconds": round(training_seconds, 1),
        "data_seconds": round(data_seconds, 1),
        "features_seconds": round(features_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "train_steps": config.max_steps,
        "train_sim_tau": round(metrics.get("sim_tau", 0.0), 3),
        "train_acc_depth1": round(metrics.get("acc_depth1", 0.0), 3),
        "stories": settings["stories"],
        "tree": bench["tree"],
        "prompts": bench["prompts"],
        "heads_dir": str(heads_dir),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    return results
