"""Qwen3.5's own MTP layer drafting chains on a Qwen3.5-0.8B-shaped target, side by side with plain `generate`
(timing only: random weights). What it shows is the mechanics at the real sizes: what a round costs when the MTP
layer's drafts are all right, by chain depth, with the whole 248,320-token vocabulary projected at every draft step
and with a 32,768-token draft vocabulary (`eagle_draft_vocab_size`, FastMTP's trimming; `specheads data draft-vocab
--heads mtp`).

The target and its MTP layer are made to cycle (as tests/mtp_targets.py's `cycling`): every attention, DeltaNet and
MLP output projection is zero, so the residual stream is the token's embedding, the lm_head's rows are the
embedding's permuted (the next token is cycle[x]), and the MTP layer reads only the embedding of x_{t+1}, so it
predicts x_{t+2} exactly: every draft is accepted, an upper bound on acceptance with the real costs. The draft
vocabulary holds the answer's tokens (filled up with others to its size), as a frequency-built one holds most of a
real answer's. Outputs are checked identical to plain `generate`; each prompt runs the settings in alternating order.

    python scripts/qwen_mtp_bench.py --prompts 4 --max-new-tokens 64 --depth 1,2,3,4 --draft-vocab 0,32768
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from hybrid_chain_bench import SHAPES, TINY, TINY_LAYERS
from transformers import AutoConfig, AutoModelForCausalLM

from specheads import SpeculativeLM
from specheads.heads.mtp import MtpHeads

QWEN3_5_VOCAB = 248320
ZEROED = ("o_proj.weight", "down_proj.weight", "out_proj.weight")  # every layer's output projections


def cycling_target_and_heads(shape: dict, draft_vocab: int, seed: int = 0) -> tuple[torch.nn.Module, list[int],
                                                                                     dict[int, MtpHeads]]:
    """(a Qwen3.5-shaped target whose next token after x is cycle[x], cycle, {draft vocabulary size (0: whole):
    MTP heads that predict the token after next exactly})."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_5_text", **shape, tie_word_embeddings=False, mtp_num_hidden_layers=1)
    target = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    target.generation_config.eos_token_id = None  # every answer runs its full length
    vocab = config.vocab_size
    cycle = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        for name, parameter in target.named_parameters():
            if name.endswith(ZEROED):
                parameter.zero_()
        target.lm_head.weight.copy_(50 * target.get_input_embeddings().weight[torch.argsort(cycle)])
    heads = {}
    for size in sorted({0, draft_vocab}):
        mtp = MtpHeads(MtpHeads.config_for(target, eagle_draft_vocab_size=size)).eval().requires_grad_(False)
        hidden = config.hidden_size
        with torch.no_grad():
            for name, parameter in mtp.layer.named_parameters():
                if name.endswith(ZEROED) or "norm" in name:  # Qwen's norms scale by 1 + w: w = 0 is the identity
                    parameter.zero_()
            mtp.layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
        mtp.attach_target(target)
        heads[size] = mtp
    return target, cycle.tolist(), heads


def draft_vocab_for(answer: list[int], size: int, vocab: int, seed: int) -> torch.Tensor:
    """`size` sorted ids: the answer's tokens, then others at random."""
    chosen = set(answer)
    others = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    for token in others:
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen)[:size])


def draft_step_ms(heads: MtpHeads, repeats: int = 20) -> float:
    """Milliseconds of one draft step's projection (`draft_logits` of one position)."""
    hidden = torch.randn(1, 1, heads.config.hidden_size)
    with torch.no_grad():
        heads.draft_logits(hidden)
        start = time.perf_counter()
        for _ in range(repeats):
            heads.draft_logits(hidden)
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", default="1,2,3,4", help="comma list: drafted tokens per chain")
    parser.add_argument("--draft-vocab", default="0,32768", help="comma list of draft vocabulary sizes (0: whole)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.draft_vocab.split(",")]
    shape = dict(SHAPES["qwen3_5_text"], vocab_size=QWEN3_5_VOCAB)
    if args.tiny:
        shape.update(TINY, layer_types=TINY_LAYERS["qwen3_5_text"])
    target, cycle, heads = cycling_target_and_heads(shape, max(sizes))
    heads = {size: heads[size] for size in sizes}
    projection_ms = {size: draft_step_ms(mtp) for size, mtp in heads.items()}
    print("draft step projection ms by draft vocabulary: " + ", ".join(
        f"{size or 'whole'}: {ms:.1f}" for size, ms in projection_ms.items()), flush=True)
    settings = list(itertools.product([int(d) for d in args.depth.split(",")], sizes))
    results = {setting: {"ratios": [], "taus": []} for setting in settings}
    generator, baseline_tps = torch.Generator().manual_seed(2), []
    vocab = shape["vocab_size"]
    with torch.no_grad():
        target.generate(torch.randint(5, vocab, (1, 8)), max_new_tokens=4, do_sample=False)  # warm-up
        for index in range(args.prompts):
            ids = torch.randint(5, vocab, (1, args.prompt_tokens), generator=generator)
            start = time.perf_counter()
            reference = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            plain_tps = args.max_new_tokens / (time.perf_counter() - start)
            baseline_tps.append(plain_tps)
            answer = reference[0, args.prompt_tokens - 1:].tolist()
            assert answer[1:] == [cycle[token] for token in answer[:-1]], "the target does not cycle"
            for size, mtp in heads.items():
                if size:
                    mtp.set_draft_vocab(draft_vocab_for(answer, size, vocab, seed=index))
            for depth, size in settings if index % 2 == 0 else settings[::-1]:
                lm = SpeculativeLM(target, heads[size])
                lm.configure_tree(tree_depth=depth, tree_top_k=1, tree_num_nodes=depth)
                out = lm.generate(ids, max_new_tokens=args.max_new_tokens)
                if not torch.equal(out, reference):
                    raise SystemExit(f"prompt {index}: output differs from plain generate (depth {depth}, vocab {size})")
                results[(depth, size)]["ratios"].append(lm.last_stats["tokens_per_second"] / plain_tps)
                results[(depth, size)]["taus"].append(lm.last_stats["mean_accepted"])
            print(f"prompt {index + 1}/{args.prompts}: plain {plain_tps:.2f} tokens/s", flush=True)
    rows = []
    for (depth, size), result in results.items():
        rows.append({"depth": depth, "draft_vocab": size or vocab, "tau": statistics.mean(result["taus"]),
                     "speedup_median": statistics.median(result["ratios"])})
        print(f"chain {depth}, draft vocabulary {size or vocab}: tau {rows[-1]['tau']:.2f}, "
              f"{rows[-1]['speedup_median']:.2f}x plain generate")
    report = {"shape": shape, "threads": args.threads, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "plain_tokens_per_second_median": statistics.median(baseline_tps), "settings": rows,
              "draft_projection_ms": {str(size or vocab): ms for size, ms in projection_ms.items()},
              "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
