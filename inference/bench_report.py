"""Benchmark report: a markdown table and PNG plots (speedup by category, acceptance by depth)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def markdown_table(results: dict[str, Any]) -> str:
    """One table per decoding mode: a row per category, then the overall row."""
    env = results["environment"]
    drafting = (f"draft model `{results['heads']}`" if results["head_type"] == "draft_model"
                else f"{results['head_type']} heads")
    lines = [f"Target `{results['target']}`, {drafting}, tree {results['tree']}, "
             f"{env['device']}, {env['dtype']}, {env['threads']} threads, max_new_tokens={results['max_new_tokens']}", ""]
    for mode in ("greedy", "sample"):
        if mode not in results:
            continue
        peers = [p for p in ("prompt_lookup", "assisted") if f"{p}_speedup" in results[mode]["overall"]]
        static = "speedup_vs_static" in results[mode]["overall"]  # CUDA greedy: our graphed plain decoding too
        header = "| category | prompts | tau | tokens/s | baseline tokens/s | speedup |" + "".join(
            f" {p.replace('_', '-')} speedup |" for p in peers)
        header += " our plain decoding tokens/s | speedup vs it |" if static else ""
        lines += [f"**{mode}**", "", header, "|" + "---|" * (6 + len(peers) + 2 * static)]
        by_turn = [(f"turn {t}", agg) for t, agg in results[mode].get("by_turn", {}).items()]
        rows = list(results[mode]["by_category"].items()) + by_turn + [("**overall**", results[mode]["overall"])]
        for name, agg in rows:
            lines.append(
                f"| {name} | {agg['prompts']} | {agg['tau']:.2f} | {agg['tokens_per_second']:.1f} | "
                f"{agg['baseline_tokens_per_second']:.1f} | {agg['speedup']:.2f}x |"
                + "".join(f" {agg[f'{p}_speedup']:.2f}x |" for p in peers)
                + (f" {agg['static_baseline_tokens_per_second']:.1f} | {agg['speedup_vs_static']:.2f}x |" if static else "")
            )
        lines.append("")
    return "\n".join(lines)


def write_report(results: dict[str, Any], json_path: Path) -> str:
    """Write <name>.md and PNG plots beside the JSON; returns the markdown. Plots need matplotlib."""
    table = markdown_table(results)
    json_path.with_suffix(".md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[specheads bench] matplotlib not installed: no plots (pip install 'specheads[bench]')")
        return table
    mode = "greedy" if "greedy" in results else "sample"
    categories = results[mode]["by_category"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(categories), [c["speedup"] for c in categories.values()], color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_ylabel("speedup vs plain generate")
    ax.set_title(f"{results['head_type']} heads on {results['target']} ({mode})")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(json_path.with_name(json_path.stem + "_speedup_by_category.png"), dpi=120)
    plt.close(fig)
    per_depth = results[mode]["overall"]["accepted_per_depth"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(1, len(per_depth) + 1), per_depth, color="#55a868")
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("rounds accepting >= d drafts")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance by depth (tau {results[mode]['overall']['tau']:.2f})")
    fig.tight_layout()
    fig.savefig(json_path.with_name(json_path.stem + "_acceptance_by_depth.png"), dpi=120)
    plt.close(fig)
    return table
