"""`SpeculativeLM`: a frozen target plus draft heads, with a `generate` shaped like transformers'.

Each round reads as four phases: draft (heads propose a tree), verify (one target forward over the
tree), accept (longest valid path + the target's bonus token), update (compact caches, emit tokens).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from specheads.heads.base import DraftHeads
from specheads.heads.draft_model import check_drafting_source, draft_model_heads
from specheads.heads.loading import load_heads
from specheads.heads.mtp import MtpHeads
from specheads.inference.accept import accept_greedy, accept_tree
from specheads.inference.batch_request import (
    BatchRequest,
    build_batch_request,
    check_batching_options,
    check_prediction,
)
from specheads.inference.batched import generate_batched
from specheads.inference.certified_argmax import CertifiedArgmax
from specheads.inference.chain_verify import CHAINS_ONLY, ChainVerifier
from specheads.inference.corpus_lookup import CorpusLookup, corpus_for_target
from specheads.inference.cpu_kernels import CpuKernels
from specheads.inference.drafting import (
    Drafter,
    constrain_drafts,
    start_sequence,
)
from specheads.inference.fast_path import FastPathRunner, fast_path_runner
from specheads.inference.generate_inputs import (
    assemble,
    decoding_settings,
    eos_ids,
    expand_for_return_sequences,
    finish_stats,
    new_token_budget,
    settings_and_inputs,
    split_prompts,
)
from specheads.inference.heads_drafter import heads_drafter
from specheads.inference.lookup import LookupDrafter, check_lookup_settings, with_prediction
from specheads.inference.multimodal import check_prompt_inputs_call
from specheads.inference.prompt_cache import PromptCache, check_prompt_cache_call
from specheads.inference.round_budget import AutoRoundBudget, calibrate_verification_ms, selectable_nodes
from specheads.inference.sampling import SamplingParams, choose_token
from specheads.inference.sequence_processors import SequenceContext
from specheads.inference.step_scores import StepRecorder, generate_output
from specheads.inference.stopping import StopChecker, emit_tokens
from specheads.inference.target_support import check_one_device, check_tree_verification, verifies_chains
from specheads.inference.tree import StaticTree
from specheads.inference.tree_description import describe_tree
from specheads.inference.verify import DynamicTreeVerifier
from specheads.targets import load_target


class SpeculativeLM(CpuKernels):
    """Speculative generation with a frozen target and trained draft heads.

    Greedy outputs are token-identical to `target.generate(do_sample=False)`; sampling follows the
    target's exact distribution (temperature / top-k / top-p applied as transformers does).

    Args:
        target: the frozen target (any `AutoModelForCausalLM` of a supported family).
        heads: heads built for this target (`create_heads` / `load_heads`), or a draft model or the target's MTP
            layer as heads (`DraftModelHeads`, `MtpHeads`). tokenizer: optional; used by the CLI and streamers.
        tree: Medusa only: a `StaticTree` or the name/path of one (default: the checkpoint's `static_tree`).
        tree_depth, tree_top_k, tree_num_nodes: EAGLE only: dynamic tree shape (default: the checkpoint's).
            Every tree default is the checkpoint's for the target's device: on a CPU, the fields its `cpu_tree`
            sets replace the others (a smaller tree where each verified node costs time).
        tree_stop_prob: EAGLE only: no deeper level once the best path's probability under the head is below this.
        tree_min_prob: EAGLE only: verify only the drafted nodes whose path probability under the head is at
            least this (the best one always; 0 = always `tree_num_nodes`). Pays where each verified node costs
            time (CPUs); such drafters run eagerly on the GPU fast path.
        graphed_rounds: fast path only: greedy rounds of EAGLE / EAGLE-3 heads run as ONE CUDA graph each
            (verify, accept, compact, draft; inference/graphed_round.py) instead of two graphs joined by eager
            glue. None (default): when the fast path captures graphs (CUDA); True: also eagerly on the CPU (how
            it is tested); False: the per-phase loop. A failed capture falls back to the per-phase graphs.
        graphed_prefill: fast path only: the prompt's forward padded to a multiple of 64 tokens, a CUDA graph per
            padded length (`GraphedPrefill`, inference/fast_path.py). None (default): where the fast path captures
            graphs (CUDA), for prompts up to 512 tokens (longer ones run eagerly); True: every prompt, also eagerly
            on the CPU (how it is tested); False: eager prompt forwards.
        lookup_tokens: prompt lookup in the tree (inference/lookup.py): each round, the tokens that followed the
            latest earlier occurrence of the context's last `lookup_max_ngram` (down to 2) tokens, at most this
            many, are grafted onto the heads' tree as one more branch (0 = off). Any heads; exact either way.
        lookup_max_ngram: the longest context suffix prompt lookup matches.
        max_round_nodes: batched decoding (`generate(batched=True)`, `BatchEngine`, the server): tree nodes one round
            verifies at most, all rows together; each row's tree shrinks to max(1, this // rows) nodes and at 1 a
            row decodes plainly (inference/batched.py). "auto": the nodes per row chosen before each round from
            measured costs and acceptance (inference/round_budget.py; the target's verification cost is measured
            once, at the first batched round). None (default): full trees whatever the batch.
        prefill_chunk: batched decoding: a joining prompt with more tokens to run than this prefills that many per
            round, so rows already decoding wait at most one chunk's forward a round (inference/chunked_prefill.py).
            None (default): in one forward as it joins.
        lookup_max_tokens: let the guess grow while whole guesses are accepted (doubling from `lookup_tokens` up to
            this; back to `lookup_tokens` after any other round): fewer rounds over copied passages. Default
            (None): `lookup_tokens`, a fixed length.
        lookup_corpus: corpus lookup (inference/corpus_lookup.py): a `CorpusLookup`, or the path of a saved corpus
            (`specheads data lookup-corpus`; a folder holding `lookup_corpus.npy`): each round, the continuations
            of the context's longest match in the target's earlier answers are grafted onto the tree too, and a
            lookup made with `online_tokens` learns every answer this SpeculativeLM finishes. Any heads; exact.
        corpus_tokens: the corpus' guessed nodes per round, at most.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        heads: DraftHeads,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tree: StaticTree | str | None = None,
        tree_depth: int | None = None,
        tree_top_k: int | None = None,
        tree_num_nodes: int | None = None,
        tree_stop_prob: float | None = None,
        tree_min_prob: float | None = None,
        graphed_rounds: bool | None = None,
        graphed_prefill: bool | None = None,
        lookup_tokens: int = 0,
        lookup_max_ngram: int = 3,
        lookup_max_tokens: int | None = None,
        lookup_corpus: CorpusLookup | str | os.PathLike | None = None,
        corpus_tokens: int = 8,
        max_round_nodes: int | str | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        if not isinstance(heads, DraftHeads):
            raise TypeError(f"heads must be a specheads DraftHeads, got {type(heads).__name__}")
        check_tree_verification(target, chains=True)  # ALiBi, recurrent layers, ...: refused by name, never inexact
        check_one_device(target)  # a device_map over several devices: refused by name
        heads.attach_target(target)  # raises when heads and target do not match
        self.target, self.heads, self.tokenizer = target.eval(), heads.eval(), tokenizer
        self.verifies_chains = verifies_chains(target)  # a hybrid: paths as chains (inference/chain_verify.py)
        self.configure_tree(tree, tree_depth, tree_top_k, tree_num_nodes, tree_stop_prob, tree_min_prob)
        self.configure_lookup(lookup_tokens, lookup_max_ngram, lookup_max_tokens, lookup_corpus, corpus_tokens)
        self.last_stats: dict[str, Any] = {}
        self._fast_runner: FastPathRunner | None = None  # the GPU fast path's cache and graphs, reused across calls
        self.graphed_rounds = graphed_rounds
        self.graphed_prefill = graphed_prefill
        check_batching_options(max_round_nodes, prefill_chunk)
        self.max_round_nodes, self.prefill_chunk = max_round_nodes, prefill_chunk
        self.certified_argmax: CertifiedArgmax | None = None  # greedy verification's scorer (use_certified_argmax)
        self._verification_ms: dict[int, float] | None = None  # measured once (verification_ms_by_tokens)
        self._round_budget: AutoRoundBudget | None = None  # max_round_nodes="auto", kept across calls

    def configure_tree(
        self,
        tree: StaticTree | str | None = None,
        tree_depth: int | None = None,
        tree_top_k: int | None = None,
        tree_num_nodes: int | None = None,
        tree_stop_prob: float | None = None,
        tree_min_prob: float | None = None,
    ) -> None:
        """Choose the draft tree: a static tree for Medusa, a dynamic tree shape for EAGLE (None = the checkpoint's
        default for the target's device, `HeadsConfig.tree_defaults`).

        The prompt-lookup branch (`configure_lookup`) stays as it was."""
        lookup = getattr(self, "drafter", None)  # None on the first call (from __init__)
        self.drafter: Drafter = heads_drafter(
            self.heads, self.target.device.type, self.target.dtype, self.verifies_chains, tree, tree_depth, tree_top_k,
            tree_num_nodes, tree_stop_prob, tree_min_prob)
        if isinstance(lookup, LookupDrafter):  # prompt lookup stays on, around the new heads' drafter
            self.drafter = lookup.around(self.drafter)

    def use_drafter(self, drafter: Drafter) -> None:
        """Draft with your own `drafter` (the `Drafter` protocol of inference/drafting.py: `reset()`, `propose(features,
        next_tokens) -> (tokens, TreeBuffers)`, optionally `fork()` for batches and `begin(first_token)`): any tree it
        proposes is verified as the heads' are, so outputs stay the target's. Prompt lookup, when on, stays grafted
        onto its trees; `configure_tree` puts the heads' drafter back."""
        lookup = self.drafter if isinstance(self.drafter, LookupDrafter) else None
        self.drafter = drafter if lookup is None else lookup.around(drafter)
        self._round_budget = None  # measured for the old drafter's trees

    def configure_lookup(
        self,
        lookup_tokens: int,
        lookup_max_ngram: int = 3,
        lookup_max_tokens: int | None = None,
        lookup_corpus: CorpusLookup | str | os.PathLike | None = None,
        corpus_tokens: int = 8,
    ) -> None:
        """Graft prompt lookup's guess of up to `lookup_tokens` tokens onto every draft tree (0 = off; see the class
        docstring and inference/lookup.py), growing up to `lookup_max_tokens` while whole guesses are accepted
        (None: a fixed length), and the guesses of `lookup_corpus` (up to `corpus_tokens` nodes; None = none).
        Kept when `configure_tree` changes the heads' tree."""
        check_lookup_settings(lookup_tokens, lookup_max_ngram, lookup_max_tokens, corpus_tokens)
        if lookup_corpus is not None:
            lookup_corpus = corpus_for_target(lookup_corpus, self.target.get_input_embeddings().num_embeddings)
        inner = self.drafter.drafter if isinstance(self.drafter, LookupDrafter) else self.drafter  # lookup's host
        self.drafter = (
            LookupDrafter(inner, lookup_tokens, lookup_max_ngram, max_tokens=lookup_max_tokens,
                          corpus=lookup_corpus, corpus_tokens=corpus_tokens)
            if lookup_tokens or lookup_corpus is not None
            else inner
        )

    def tree_description(self) -> dict[str, Any]:
        """The current tree, for logs and benchmark JSON (`lookup_tokens`: the prompt-lookup branch, 0 = none;
        `chain`: a hybrid target verifying paths as chains; inference/tree_description.py)."""
        return describe_tree(self)

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike,
        heads: str | os.PathLike | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        draft_model: str | os.PathLike | None = None,
        early_exit_layers: int | None = None,
        mtp: bool = False,
        **kwargs: Any,
    ) -> SpeculativeLM:
        """Load a target (path, Hub id or alias) and what drafts for it, then build the model: `heads` (folder or Hub
        id), or a `draft_model` (path, Hub id or alias; no training; best one of the target's tokenizer, another
        one drafts the tokens both share), or the target's own first `early_exit_layers` layers (self-speculation),
        or with `mtp=True` the target's own MTP layer (DeepSeek-V3, GLM-4.5, Qwen3.5, ...; heads/mtp.py); exactly one.

        Heads trained jointly with a LoRA adapter on the target (Medusa-2) get it merged into the target first.
        """
        from specheads.heads.adapter import apply_target_adapter

        check_drafting_source(heads, draft_model, early_exit_layers, mtp)
        if dtype is None and device is not None and torch.device(device).type == "cuda":
            dtype = torch.bfloat16  # on GPUs the target (and the heads, which follow it) run in bf16; fp32 on CPU
        target_model, tokenizer = load_target(target, dtype=dtype, device=device)
        if mtp:
            return cls(target_model, MtpHeads.from_target(target_model), tokenizer=tokenizer, **kwargs)
        if heads is None:
            drafting = draft_model_heads(target_model, tokenizer, draft_model, early_exit_layers, dtype, device)
            return cls(target_model, drafting, tokenizer=tokenizer, **kwargs)
        target_model = apply_target_adapter(target_model, heads)  # unchanged for heads without an adapter
        return cls(target_model, load_heads(heads, target=target_model), tokenizer=tokenizer, **kwargs)

    def verification_ms_by_tokens(self) -> dict[int, float]:
        """{T: milliseconds} of the target's verification forward over T = 1, 2, 4, ... 128 tree tokens, measured on
        the first call (a few seconds on a CPU for a 135M target) and kept: what `max_round_nodes="auto"` weighs
        tree sizes with. Measure after choosing the CPU kernels (`use_cpu_kernels`), which change it."""
        if self._verification_ms is None:
            self._verification_ms = calibrate_verification_ms(self)
        return self._verification_ms

    def auto_round_budget(self) -> AutoRoundBudget:
        """The chooser of nodes per row for `max_round_nodes="auto"` (inference/round_budget.py), built on first
        use and kept, so that what one batched call or server round measured carries over to the next (a new tree
        shape, `configure_tree`, gets a new one). Engines on several threads share it: their measurements mix,
        which only moves estimates."""
        full_nodes = selectable_nodes(self.drafter)
        if self._round_budget is None or self._round_budget.full_nodes != full_nodes:
            self._round_budget = AutoRoundBudget(self.verification_ms_by_tokens(), full_nodes)
        return self._round_budget

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        typical_p: float | None = None,
        repetition_penalty: float | None = None,
        no_repeat_ngram_size: int | None = None,
        min_new_tokens: int | None = None,
        bad_words_ids: list[list[int]] | None = None,
        suppress_tokens: list[int] | None = None,
        sequence_bias: Any = None,
        prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        stop_strings: str | list[str] | None = None,
        max_time: float | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        generation_config: GenerationConfig | None = None,
        max_length: int | None = None,
        num_return_sequences: int | None = None,
        return_dict_in_generate: bool | None = None,
        output_scores: bool | None = None,
        output_logits: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        streamer: Any | None = None,
        prompt_cache: PromptCache | None = None,
        acceptance: str = "exact",
        batched: bool | None = None,
        fast_path: bool | None = None,
        prediction: list[int] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Generate like `transformers.generate`: returns prompt + new tokens, (B, n + new).

        Args:
            input_ids: (B, n) or (n,) prompt ids; left padding with `attention_mask` for B > 1.
            attention_mask: (B, n), 1 for real tokens.
            max_new_tokens: new tokens at most (0 returns the prompt; default 128, or what `max_length` leaves).
            do_sample, temperature, top_p, top_k, min_p, typical_p, repetition_penalty, no_repeat_ngram_size,
                min_new_tokens, bad_words_ids, suppress_tokens, sequence_bias: as in transformers; None takes the
                target's generation config (min_length, begin_suppress_tokens and the epsilon / eta cutoffs too),
                then transformers' defaults (temperature 1.0, top_p 1.0, top_k 50, the others off). The processors
                that read the sequence (penalty, n-grams, lengths, biases, bans) make each tree node's logits depend
                on its own path: processed on the host at the nodes acceptance reaches (on the fast path, in the
                per-phase loop rather than one graph per round).
            prefix_allowed_tokens_fn, logits_processor: as in transformers (constrained decoding: grammars, JSON
                schemas, allowed-token functions), applied at transformers' place in the processing; each tree node
                is processed with its own sequence, so they must be functions of each row's input_ids (called with
                a tree depth's nodes as rows, batch_id = the caller's row; inference/sequence_processors.py).
            stopping_criteria, stop_strings, max_time: as in transformers; checked after every emitted token, so a
                row ends exactly where `generate` would end it (the token that completes a stop string kept).
                `stop_strings` and `max_time` default to the target's generation config; stop strings need
                `tokenizer` (default: this model's). Criteria get scores=None (inference/stopping.py).
            generation_config: a `GenerationConfig` used instead of the target's own for every default above (as
                transformers' argument of that name).
            max_length: prompt (padded batch width) + new tokens at most, as in transformers, when max_new_tokens is
                not given (max_new_tokens wins when both are).
            num_return_sequences: sampled continuations per prompt, as in transformers (rows i * n ... i * n + n - 1
                of the output continue prompt i; default: the generation config's, else 1; greedy takes only 1).
            return_dict_in_generate, output_scores, output_logits: as in transformers (default: the generation
                config's): a `GenerateDecoderOnlyOutput` with `sequences` and, per generated token, the (B, V)
                float32 scores it was chosen from (processed; warped when sampling) / the target's logits
                (inference/step_scores.py). Steps past the end of a row that stopped early hold -inf.
            eos_token_id: int or list; default from the target's generation config. Generation stops right
                after it (the EOS token is included, as transformers does).
            pad_token_id: fills rows that stopped early (default: generation config's pad, else EOS).
            streamer: a transformers `TextStreamer` / `TextIteratorStreamer` (batch size 1).
            prompt_cache: a `PromptCache` kept across calls (multi-turn chat, batch size 1): the target runs only
                the prompt's tokens after the longest prefix the cache holds from the previous call, and the cache
                then holds this call's sequence (inference/prompt_cache.py).
            acceptance: "exact" (lossless) or "typical" (Medusa's, lossy, sampling only).
            batched: for B > 1, verify all rows in one target forward or, with False, run the rows one after
                another (the reference scheme). None (default): batched, except where the fast path runs (CUDA),
                whose rows go one after another: batched rounds run eagerly, 15x a fast-path round on an H200.
            fast_path: run rows on a static KV cache with fixed-shape tree verification, captured as a CUDA
                graph on CUDA (inference/fast_path.py). None: on for a CUDA target unless batched=True (not for
                sliding-window targets whose window could be reached); True forces it (also on CPU); False: off.
            prediction: token ids every row's answer is expected to resemble (OpenAI's Predicted Outputs: the text
                being edited): drafted from like the context (`lookup.with_prediction`); the output is unchanged.
                Not on the fast path (refused: pass fast_path=False).
            **kwargs: as in transformers: any other field of `GenerationConfig` (e.g. `epsilon_cutoff`, or `num_beams`,
                refused when > 1) updates a copy of the generation config; the rest are extra inputs of the target's
                prompt forward: a vision-language target's images (`pixel_values`, `image_grid_thw`, ... as its
                processor returns them; inference/multimodal.py), for one unpadded prompt per call. A name that is
                neither raises a TypeError naming it.

        After the call, `self.last_stats` holds new_tokens, target_forwards, mean_accepted (tau: new tokens
        per target forward, the bonus token counted, the prefill counted as one forward), rounds,
        accepted_per_depth (fraction of rounds accepting at least d drafted tokens), seconds, tokens_per_second,
        prefill_seconds (prompt forwards up to the first token), ms_per_round (the rest of the time per round: drafting, verification, acceptance) and
        fast_path (whether the call ran on the static-cache fast path).
        """
        config = self.target.generation_config if generation_config is None else generation_config
        config, inputs = settings_and_inputs(config, self.target, kwargs)
        check_prompt_inputs_call(inputs, input_ids, attention_mask, batched)
        params, criteria = decoding_settings(
            config, self.tokenizer, do_sample, temperature, top_p, top_k, min_p=min_p, typical_p=typical_p,
            repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
            min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids, suppress_tokens=suppress_tokens,
            sequence_bias=sequence_bias, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            logits_processor=logits_processor, stopping_criteria=stopping_criteria, stop_strings=stop_strings,
            max_time=max_time, tokenizer=tokenizer, acceptance=acceptance,
        )
        max_new_tokens = new_token_budget(input_ids, max_new_tokens, max_length)
        if num_return_sequences is None:
            num_return_sequences = getattr(config, "num_return_sequences", None) or 1
        input_ids, attention_mask = expand_for_return_sequences(input_ids, attention_mask, num_return_sequences, do_sample)
        prompts = split_prompts(input_ids, attention_mask, max_new_tokens, self.target, self.heads.config.vocab_size)
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"streamers support batch size 1 only (as in transformers), got batch size {len(prompts)}")
        eos_list = eos_ids(eos_token_id, config)
        output_scores, output_logits, return_dict_in_generate = (
            bool(getattr(config, name, False)) if value is None else value
            for name, value in (("output_scores", output_scores), ("output_logits", output_logits),
                                ("return_dict_in_generate", return_dict_in_generate))
        )
        record = return_dict_in_generate and (output_scores or output_logits)
        recorders = [StepRecorder(params) for _ in prompts] if record else None
        eos = set(eos_list)
        stats = {"new_tokens": 0, "target_forwards": 0, "rounds": 0, "accepted_counts": [], "prefill_seconds": 0.0,
                 "reused_prompt_tokens": 0}
        start = time.perf_counter()
        can_batch = hasattr(self.drafter, "fork") and not self.verifies_chains  # chains: row by row
        if prompt_cache is not None:
            check_prompt_cache_call(prompt_cache, len(prompts), batched)
        runner, row_drafter = self.fast_path_for(fast_path, prompts, max_new_tokens, batched)
        stats["fast_path"] = runner is not None
        if prediction is not None and runner is not None:
            raise ValueError("prediction= is drafted from on the eager path only: pass fast_path=False with it")
        check_prediction(prediction, self.heads.config.vocab_size)
        if batched is None:
            batched = len(prompts) > 1 and can_batch and runner is None and not inputs
        if batched and not can_batch:
            raise ValueError(f"{CHAINS_ONLY}: a batch's sequences run one after another, use batched=False"
                             if self.verifies_chains
                             else f"batched=True needs a drafter with fork(); {type(self.drafter).__name__} has none: "
                             "use batched=False")
        if batched:
            stops = [None if criteria is None else StopChecker(criteria, p) for p in prompts]
            rows = generate_batched(self, prompts, max_new_tokens, params, eos, acceptance, stats, stops, recorders,
                                    prediction)
        else:
            verifier = runner if runner is not None else self.eager_verifier(params)
            rows = []
            for row, prompt in enumerate(prompts):
                if streamer is not None:
                    streamer.put(prompt.cpu())
                stop = None if criteria is None else StopChecker(criteria, prompt)
                rows.append(self._generate_row(prompt, max_new_tokens, params, eos, streamer, acceptance, stats, verifier,
                                               row_drafter, row, stop, None if recorders is None else recorders[row],
                                               prompt_cache, inputs, prediction))
        if streamer is not None:
            streamer.end()
        seconds = time.perf_counter() - start
        self.last_stats = finish_stats(stats, seconds)
        sequences = assemble(input_ids, rows, pad_token_id, eos_list, config)
        if not return_dict_in_generate:
            return sequences
        return generate_output(sequences, recorders or [], output_scores, output_logits)

    def fast_path_for(
        self, fast_path: bool | None, prompts: list[torch.Tensor], max_new_tokens: int, batched: bool | None = False,
    ) -> tuple[FastPathRunner | None, Drafter]:
        """(the fast path's runner, the drafter its rows draft with) for these (n,) prompts, or (None, self.drafter)
        for the normal path (`fast_path`: as `generate`'s). The runner is kept across calls: its static cache and CUDA
        graphs are reused."""
        runner = fast_path_runner(self, fast_path, prompts, max_new_tokens, batched, self._fast_runner)
        if runner is None:
            return None, self.drafter
        self._fast_runner = runner
        runner.graphed_prefill = self.graphed_prefill
        return runner, runner.use_drafter(self.drafter)

    def eager_verifier(self, params: SamplingParams) -> DynamicTreeVerifier:
        """The normal path's verifier for one row: a `DynamicTreeVerifier`, or a `ChainVerifier` on a hybrid target;
        greedy verification scored by `certified_argmax` (when set) unless the sampling params read the sequence."""
        verifier_class = ChainVerifier if self.verifies_chains else DynamicTreeVerifier
        argmax = None if params.reads_sequence else self.certified_argmax
        return verifier_class(self.target, self.heads.select_features, argmax=argmax)

    def batch_request(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, **options: Any) -> BatchRequest:
        """One prompt as a request for a `BatchEngine` (continuous batching), checked as `generate` checks it:
        `batched.build_batch_request` (its options: generate's, and record_logits, seed)."""
        return build_batch_request(self, input_ids, max_new_tokens, **options)

    # --- the loop ---------------------------------------------------------------------------------------
    def _generate_row(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        eos: set[int],
        streamer: Any | None,
        acceptance: str,
        stats: dict[str, Any],
        verifier: DynamicTreeVerifier | FastPathRunner,
        drafter: Drafter,
        row: int = 0,
        stop: StopChecker | None = None,
        recorder: StepRecorder | None = None,
        prompt_cache: PromptCache | None = None,
        inputs: dict[str, torch.Tensor] | None = None,
        prediction: list[int] | None = None,
    ) -> list[int]:
        """Speculative decoding of one prompt (n,), row `row` of the caller's batch; returns the new token ids.

        `verifier` is the target's side of each round: a `DynamicTreeVerifier`, or the GPU fast path's
        `FastPathRunner` (static cache, CUDA-graph verification); both give the same tokens. `drafter` is
        `self.drafter`, or on the fast path its fixed-shape version (`FastPathRunner.use_drafter`). With
        `graphed_rounds`, greedy decoding with that fixed-shape EAGLE drafter runs each round as one graph
        (`FastPathRunner.graphed_round`, inference/graphed_round.py); everything else runs the four phases below,
        the reference. With `prompt_cache`, the prefill runs only the prompt's tokens
        after those the cache holds, and the cache keeps this call's sequence at the end. `inputs`: the prompt's
        extra model inputs (images), given to the prefill only (`DynamicTreeVerifier` only).
        """
        if max_new_tokens == 0:
            return []
        prefill_start = time.perf_counter()
        if prompt_cache is not None:
            last_logits, features, reused = prompt_cache.prefill(verifier, prompt, max_new_tokens, self.target,
                                                                 self.heads, inputs)
            stats["reused_prompt_tokens"] += reused
            committed_features = [features]  # (n, h), then each round's path: the features of the cache's positions
        elif inputs:
            last_logits, features = verifier.prefill(prompt, max_new_tokens, inputs=inputs)  # (1, V), (n, h)
        else:
            last_logits, features = verifier.prefill(prompt, max_new_tokens)  # (1, V), (n, h)
        stats["target_forwards"] += 1
        # the sequence so far, for processors that read it (repetition penalty, n-gram blocking, ...)
        context = SequenceContext(prompt, params, sorted(eos), row) if params.reads_sequence else None
        raw_logits = last_logits
        if context is not None:
            last_logits = context.last(last_logits)
        root = choose_token(last_logits, params)[0]
        new_tokens: list[int] = []
        done = emit_tokens([int(root)], new_tokens, max_new_tokens, eos, streamer, stop)  # int(): waits for the prefill
        if recorder is not None:
            recorder.add(raw_logits, recorder.warped(last_logits.float()), len(new_tokens))
        if context is not None:
            context.commit(root)
        stats["prefill_seconds"] += time.perf_counter() - prefill_start
        next_tokens = torch.cat([prompt[1:], root[None]])  # the token that followed each feature
        prefix_length = prompt.shape[0]
        start_sequence(drafter, prompt)
        if prediction:  # OpenAI's Predicted Outputs: guessed from like the context
            drafter = with_prediction(drafter, prediction)
        constrain_drafts(drafter, context, self.heads.config.vocab_size)  # processors that ban: allowed drafts only
        graphed = None
        if (isinstance(verifier, FastPathRunner) and not params.do_sample and acceptance == "exact" and context is None
                and recorder is None and not verifier.position_offset):
            wanted = verifier.use_graphs if self.graphed_rounds is None else self.graphed_rounds
            graphed = verifier.graphed_round(drafter) if wanted else None
        if graphed is not None and not done:
            # The whole round (verify, accept, update, draft) is one graph replay; one host read per round.
            graphed.start(features, next_tokens, prefix_length)  # drafts the first tree
            while not done:
                accepted_tokens = graphed.step()  # the (L+1) accepted tokens: L drafted + the bonus
                if prompt_cache is not None:  # the path's (L+1, h) features, as the per-phase loop keeps them
                    committed_features.append(graphed.path_features(len(accepted_tokens)))
                stats["target_forwards"] += 1
                stats["rounds"] += 1
                stats["accepted_counts"].append(len(accepted_tokens) - 1)
                done = emit_tokens(accepted_tokens, new_tokens, max_new_tokens, eos, streamer, stop)
        # greedy on the normal path: the target's argmax per node is all acceptance needs (scored by
        # `certified_argmax` when set, without the full-precision lm_head)
        argmax_only = (not params.do_sample and isinstance(verifier, DynamicTreeVerifier) and context is None
                       and recorder is None)
        while not done:
            # draft
            tokens, tree = drafter.propose(features, next_tokens)
            if isinstance(verifier, ChainVerifier):  # a shorter chain once enough accepted tokens wait to be rerun
                tokens, tree = verifier.limit(tokens, tree)
            # verify + accept
            if argmax_only:
                target_argmax, node_features = verifier.verify_argmax(tokens, tree, prefix_length)  # (N,), (N, h)
                path, bonus = accept_greedy(tokens, tree, target_argmax)
            else:
                logits, node_features = verifier.verify(tokens, tree, prefix_length)  # (N, V), (N, h)
                # with a context, node i's sequence is what was emitted plus its own path in the tree
                path, bonus = accept_tree(tokens, tree, logits, params, acceptance, context)
            stats["target_forwards"] += 1
            # update
            verifier.compact(prefix_length, path)
            prefix_length += path.shape[0]
            accepted = torch.cat([tokens[path[1:]], bonus[None]])
            stats["rounds"] += 1
            stats["accepted_counts"].append(path.shape[0] - 1)
            features = node_features[path]  # (L+1, h) true features of the path (a gather: a copy)
            if prompt_cache is not None:
                committed_features.append(features)
            next_tokens = accepted
            emitted = len(new_tokens)
            done = emit_tokens(accepted.tolist(), new_tokens, max_new_tokens, eos, streamer, stop)
            if recorder is not None:  # before the commit: each path node's sequence ends at the committed one
                recorder.add_path(logits, tokens, tree, path, context, len(new_tokens) - emitted)
            if context is not None:
                context.commit(accepted)
        constrain_drafts(drafter, None, 0)
        stats["new_tokens"] += len(new_tokens)
        if isinstance(drafter, LookupDrafter):  # an online corpus learns the answer
            drafter.remember(prompt, new_tokens)
        if prompt_cache is not None:
            prompt_cache.store_call(prompt, new_tokens, prefix_length, verifier.cache, torch.cat(committed_features),
                                    self.target, self.heads, inputs, getattr(verifier, "position_offset", 0))
        return new_tokens
