"""Sampling is lossless: the joint law of the first 3 sampled tokens equals the target's exact law.

A tiny random Llama with a 6-token vocabulary (lm_head scaled up so the law is far from flat) lets us
enumerate all 6^3 continuations exactly. Thousands of `SpeculativeLM.generate(do_sample=True)` runs, with
drafts that are often right, are compared with a Pearson chi-square test at p = 0.001. The same machinery
rejects deliberately wrong acceptance rules, so the test can fail.
"""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import specheads.inference.accept as accept_module
from specheads import SpeculativeLM, create_heads
from specheads.inference.openai_penalties import LogitBias, OccurrencePenalties
from specheads.inference.sampling import sample_token
from specheads.inference.tree import TreeBuffers, build_tree_buffers

from .conftest import SumModuloBan, record_tree_sizes

V = 6
PROMPT = [1, 3, 4, 5]
NUM_SAMPLES = 2000
SETTINGS = {
    "T=1.0": dict(temperature=1.0),
    "T=0.7,top_p=0.9": dict(temperature=0.7, top_p=0.9),
    "T=1.0,repetition_penalty=4.0": dict(temperature=1.0, repetition_penalty=4.0),  # each node's own path counts
    "T=1.0,no_repeat_ngram_size=2": dict(temperature=1.0, no_repeat_ngram_size=2),
    "T=0.8,min_p=0.1": dict(temperature=0.8, min_p=0.1),
    "T=1.0,typical_p=0.8": dict(temperature=1.0, typical_p=0.8),
    # a caller's processor: bans 2 of the 6 tokens, which 2 depending on the sum of the whole sequence
    "T=0.9,logits_processor": dict(temperature=0.9, logits_processor=LogitsProcessorList([SumModuloBan(3)])),
    # OpenAI's penalties over the answer's tokens (each node's own path counts) and logit biases
    "T=1.0,openai_penalties": dict(temperature=1.0, logits_processor=LogitsProcessorList([
        OccurrencePenalties(prompt_length=2, presence=0.8, frequency=1.0), LogitBias({0: -1.5, 4: 1.0})])),
}
# a shorter prompt leaves most of the 6 tokens and bigrams out of the context: the processing depends on tree paths
PROMPTS = {"T=1.0,repetition_penalty=4.0": [1, 3], "T=1.0,no_repeat_ngram_size=2": [1, 3],
           "T=0.9,logits_processor": [1, 3], "T=1.0,openai_penalties": [1, 3]}


@pytest.fixture(scope="module")
def six_token_target(tiny_target_factory):
    """A random 1-layer Llama over 6 tokens, max next-token probabilities around 0.3-0.6 (one layer: fast)."""
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=V, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target


def warped_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    min_p: float | None = None,
    typical_p: float = 1.0,
    logits_processor: LogitsProcessorList | None = None,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target's sampling law as transformers' generate builds it (its own processors, its order): (B, V) logits
    after the (B, t) `context` token ids (read by the repetition penalty)."""
    warpers = LogitsProcessorList()
    if repetition_penalty != 1.0:
        warpers.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if no_repeat_ngram_size:
        warpers.append(NoRepeatNGramLogitsProcessor(no_repeat_ngram_size))
    warpers.extend(logits_processor or [])  # the caller's, after transformers' own processors and before warping
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        warpers.append(MinPLogitsWarper(min_p))
    if typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(typical_p))
    return torch.softmax(warpers(context, logits.float().clone()), dim=-1)


class ExactLaw:
    """p1[x1], p2[x1, x2] and p3[x1, x2, x3] of the 3 tokens after `prompt`, for one sampling setting."""

    def __init__(self, target, prompt: list[int] = PROMPT, **sampling) -> None:
        self.prompt = prompt
        n = len(prompt)
        sequences = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # all 36 (x1, x2)
        with torch.no_grad():
            logits = target(input_ids=sequences).logits  # (36, n + 2, V)
        self.p1 = warped_probs(logits[0, n - 1 : n], context=sequences[:1, :n], **sampling)[0]  # (V,)
        self.p2 = warped_probs(logits[::V, n], context=sequences[::V, : n + 1], **sampling)  # (V, V): row x1
        self.p3 = warped_probs(logits[:, n + 1], context=sequences[:, : n + 2], **sampling).view(V, V, V)

    def joint(self) -> dict[tuple[int, int, int], float]:
        return {
            (a, b, c): float(self.p1[a] * self.p2[a, b] * self.p3[a, b, c])
            for a, b, c in itertools.product(range(V), repeat=3)
        }


class ArgmaxTreeDrafter:
    """Drafts from the exact law: the target's top tokens as siblings, their top tokens as children.

    Around the chain of most likely tokens it adds a second-best sibling, a duplicate of the first child
    and the least likely token (often impossible after top-p), so accepted paths, rejections, residuals
    and zero-probability drafts all occur.
    """

    def __init__(self, law: ExactLaw) -> None:
        self.law = law
        self.trees: dict[tuple[int, ...], tuple[torch.Tensor, TreeBuffers]] = {}  # by generated tokens

    def reset(self) -> None:
        self.generated: list[int] = []
        self.prompt_tokens_seen = 0

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        tokens = next_tokens.tolist()
        if not self.generated:
            tokens = tokens[len(self.law.prompt) - 1 :]  # the first call also carries prompt[1:]
        self.generated += tokens
        g = tuple(self.generated)
        if g not in self.trees:
            self.trees[g] = self.build(g)
        return self.trees[g]

    def build(self, g: tuple[int, ...]) -> tuple[torch.Tensor, TreeBuffers]:
        if len(g) == 1:
            nexts = [self.law.p2[g[0]]] + [self.law.p3[g[0], b] for b in range(V)]
        else:
            nexts = [self.law.p3[g[0], g[1]]] + [torch.ones(V) / V] * V  # deeper than 3 tokens: anything
        first = nexts[0]
        order = torch.argsort(first, descending=True, stable=True).tolist()
        out, parents = [g[-1]], [-1]
        for rank, token in enumerate([order[0], order[1], order[0], order[-1]]):
            out.append(token)
            parents.append(0)
            if rank < 2:  # the two best get children: their own two best next tokens
                child = len(out) - 1
                below = torch.argsort(nexts[1 + token], descending=True, stable=True).tolist()
                for grandchild in below[:2]:
                    out.append(grandchild)
                    parents.append(child)
        return torch.tensor(out), build_tree_buffers(torch.tensor(parents))


def sample_first_three(
    lm: SpeculativeLM, num_samples: int, seed: int, prompt: list[int] = PROMPT, **sampling
) -> list[tuple[int, int, int]]:
    """`num_samples` runs of generate(max_new_tokens=3); also counts kept drafts in `lm.accepted_drafts`."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    samples, lm.accepted_drafts = [], 0
    for _ in range(num_samples):
        out = lm.generate(ids, max_new_tokens=3, do_sample=True, **sampling)
        samples.append(tuple(out[0, len(prompt) :].tolist()))
        stats = lm.last_stats
        lm.accepted_drafts += round(sum(stats["accepted_per_depth"]) * stats["rounds"])
    return samples


def oracle_lm(target, law: ExactLaw) -> SpeculativeLM:
    lm = SpeculativeLM(target, create_heads(target, "medusa"))  # the heads only satisfy the API
    lm.drafter = ArgmaxTreeDrafter(law)
    return lm


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_oracle_drafts_sample_the_exact_joint_law(six_token_target, chi_square, setting):
    """Often-right tree drafts (siblings, duplicates, impossible tokens): first 3 tokens ~ the exact law."""
    sampling, prompt = SETTINGS[setting], PROMPTS.get(setting, PROMPT)
    law = ExactLaw(six_token_target, prompt, **sampling)
    lm = oracle_lm(six_token_target, law)
    samples = sample_first_three(lm, NUM_SAMPLES, seed=0, prompt=prompt, **sampling)
    result = chi_square(samples, law.joint())
    assert result.passed, result
    assert result.dof >= 10, result  # enough bins to see the joint law
    # The drafts were exercised: on average more than half a drafted token is kept per run.
    assert lm.accepted_drafts > 0.5 * NUM_SAMPLES


def untrained_eagle_heads(target, head_type: str):
    """Untrained EAGLE heads; EAGLE-3 ones (and EAGLE ones with `eagle_draft_vocab_size`, head_type "eagle-vocab")
    draft from a reduced vocabulary without token 2 (d2t not the identity); "eagle-pruned" ones verify only the
    nodes the heads find likely enough (trees of varying size); "eagle3-parallel" ones draft each tree in one forward,
    as "dflash" ones (a block drafter over the whole vocabulary) do."""
    torch.manual_seed(0)
    tree = dict(tree_depth=3, tree_top_k=3, tree_num_nodes=8)
    if head_type == "eagle-pruned":
        return create_heads(target, "eagle", tree_min_prob=0.04, **tree)
    if head_type in ("eagle", "dflash"):
        return create_heads(target, head_type, **tree)
    if head_type == "eagle-vocab":
        heads = create_heads(target, "eagle", eagle_draft_vocab_size=5, **tree)
        heads.set_draft_vocab(torch.tensor([0, 1, 3, 4, 5]))
        return heads
    parallel = dict(parallel_depth=3) if head_type == "eagle3-parallel" else {}  # P-EAGLE: one forward per tree
    heads = create_heads(target, "eagle3", draft_vocab_size=5, **tree, **parallel)
    heads.set_draft_vocab(torch.tensor([0, 1, 3, 4, 5]), init_lm_head_from_target=True)
    return heads


@pytest.mark.parametrize(
    ("setting", "head_type"),
    [*((setting, "eagle") for setting in SETTINGS), ("T=0.7,top_p=0.9", "eagle3"), ("T=1.0", "eagle-vocab"),
     ("T=1.0", "eagle-pruned"), ("T=0.7,top_p=0.9", "eagle3-parallel"), ("T=1.0", "dflash")],
)
def test_untrained_eagle_heads_sample_the_exact_joint_law(six_token_target, chi_square, setting, head_type):
    """Untrained EAGLE / EAGLE-3 heads (top-3 siblings cover half the vocabulary, so they often hit): same law."""
    sampling, prompt = SETTINGS[setting], PROMPTS.get(setting, PROMPT)
    law = ExactLaw(six_token_target, prompt, **sampling)
    lm = SpeculativeLM(six_token_target, untrained_eagle_heads(six_token_target, head_type))
    tree_sizes = record_tree_sizes(lm)
    samples = sample_first_three(lm, 1200, seed=1, prompt=prompt, **sampling)  # EAGLE drafting is slower: fewer runs
    result = chi_square(samples, law.joint())
    assert result.passed, result
    assert lm.accepted_drafts > 0.2 * len(samples)
    assert (len(set(tree_sizes)) > 1) == (head_type == "eagle-pruned"), set(tree_sizes)  # pruning varies the trees


def test_top_k_sampling_follows_the_exact_law(six_token_target, chi_square):
    """top_k (with a temperature above 1) is processed exactly as transformers does."""
    sampling = dict(temperature=1.3, top_k=3)
    law = ExactLaw(six_token_target, **sampling)
    samples = sample_first_three(oracle_lm(six_token_target, law), 1200, seed=2, **sampling)
    joint = law.joint()
    assert sum(p > 0 for p in joint.values()) == 27  # 3 x 3 x 3 reachable sequences
    assert chi_square(samples, joint).passed


def test_exact_law_matches_the_engine_target_probs(six_token_target):
    """The engine's `target_probs` equals the warpers used for the exact law above (same processing)."""
    from specheads.inference.sampling import SamplingParams, target_probs

    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)) * 3
    for kwargs in (
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 3},
    ):
        params = SamplingParams(do_sample=True, **kwargs)
        torch.testing.assert_close(target_probs(logits, params), warped_probs(logits, **kwargs))


# --- the test can fail ----------------------------------------------------------------------------------------
def accept_first_children(tokens: torch.Tensor, tree: TreeBuffers, probs: torch.Tensor, generator=None):
    """WRONG on purpose: always accept the first child at every depth (the draft wins)."""
    node, path = 0, [0]
    while True:
        children = [i for i in range(1, tree.num_nodes) if int(tree.parents[i]) == node]
        if not children:
            return torch.tensor(path), sample_token(probs[node])
        node = children[0]
        path.append(node)


def accept_without_residual(tokens: torch.Tensor, tree: TreeBuffers, probs: torch.Tensor, generator=None):
    """WRONG on purpose: rejection sampling that forgets to remove rejected candidates (no residual)."""
    node, path = 0, [0]
    while True:
        children = [i for i in range(1, tree.num_nodes) if int(tree.parents[i]) == node]
        for child in children:
            if torch.rand(()).item() < float(probs[node, tokens[child]]):
                node = child
                path.append(node)
                break
        else:
            return torch.tensor(path), sample_token(probs[node])


@pytest.mark.parametrize("wrong_rule", [accept_first_children, accept_without_residual])
def test_the_chi_square_test_rejects_wrong_acceptance_rules(
    six_token_target, chi_square, monkeypatch, wrong_rule
):
    """Swapping the engine's acceptance for a biased rule makes the same chi-square test fail clearly."""
    law = ExactLaw(six_token_target)
    monkeypatch.setattr(accept_module, "accept_sampling", wrong_rule)  # accept_tree looks it up there
    samples = sample_first_three(oracle_lm(six_token_target, law), 800, seed=3)
    result = chi_square(samples, law.joint())
    assert result.statistic > 2 * result.critical, result


def test_default_sampling_matches_transformers_defaults(tiny_llama):
    """`generate(do_sample=True)` without top_k samples from the same law as `target.generate(do_sample=True)`.

    transformers applies its global default top_k=50 (GenerationConfig._get_default_generation_params) when
    neither the user nor the model's generation config sets it; on a near-flat 97-token law, tokens outside
    the top 50 then never appear.
    """
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    with torch.no_grad():
        top50 = set(tiny_llama(input_ids=ids).logits[0, -1].topk(50).indices.tolist())
    torch.manual_seed(0)
    hf = {int(tiny_llama.generate(ids, max_new_tokens=1, do_sample=True)[0, -1]) for _ in range(60)}
    assert hf <= top50  # transformers: top-50 only
    lm = SpeculativeLM(tiny_llama, create_heads(tiny_llama, "medusa"))
    ours = {int(lm.generate(ids, max_new_tokens=1, do_sample=True)[0, -1]) for _ in range(60)}
    assert ours <= top50, f"sampled {sorted(ours - top50)} outside transformers' default top-50"


@pytest.mark.parametrize(
    ("setting", "do_sample"),
    [({"forced_eos_token_id": 64}, False), ({"top_h": 0.5}, True), ({"num_beams": 2}, False), ({"num_beams": 3}, True),
     ({"penalty_alpha": 0.6, "top_k": 4}, False), ({"dola_layers": "high"}, False),
     ({"encoder_repetition_penalty": 3.0}, False), ({"encoder_no_repeat_ngram_size": 2}, True),
     ({"token_healing": True}, False), ({"output_attentions": True}, False)],
)
def test_generation_settings_it_does_not_apply_are_refused(tiny_llama, setting, do_sample):
    """transformers' generate applies the target's generation config even when greedy: speculative decoding
    refuses what it does not apply (it applies temperature, top-k, top-p, min-p, typical-p, the epsilon and eta
    cutoffs, the repetition penalty, n-gram blocking, minimum lengths, sequence biases, bad words and suppressed
    tokens), naming it,
    instead of emitting other tokens than the target's own; neutral values make both agree again. Decoding modes
    other than greedy and sampling (beam search, contrastive search, DoLa) are refused the same way."""
    target = copy.deepcopy(tiny_llama)
    ids = torch.tensor([[1, 5, 9, 33, 7, 5, 9]])
    lm = SpeculativeLM(target, create_heads(target, "medusa"))
    plain = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=[])
    for name, value in setting.items():
        setattr(target.generation_config, name, value)
    name, value = next(iter(setting.items()))
    with pytest.raises(ValueError, match=re.escape(f"generation config sets {name}={value!r}, which transformers'")):
        lm.generate(ids, max_new_tokens=30, do_sample=do_sample, eos_token_id=[])
    if name in ("forced_eos_token_id", "encoder_repetition_penalty"):  # it matters: transformers' greedy output moves
        assert not torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=[]), plain)
    setattr(target.generation_config, name, None)
    assert torch.equal(lm.generate(ids, max_new_tokens=30, eos_token_id=[]), plain)


def test_sampling_cutoffs_do_not_stop_greedy_decoding(tiny_llama):
    """top_h, like min_p and typical_p, only acts when sampling (as in transformers): greedy decoding goes on."""
    target = copy.deepcopy(tiny_llama)
    target.generation_config.top_h = 0.5
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    lm = SpeculativeLM(target, create_heads(target, "medusa"))
    assert torch.equal(lm.generate(ids, max_new_tokens=20), target.generate(ids, max_new_tokens=20, do_sample=False))
