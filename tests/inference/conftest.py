"""Fixtures for the inference tests: a reference greedy decoder, an oracle drafter and a chi-square test.

Helpers are handed out as fixtures (not imported from here) so the suite works in any pytest import mode.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessor

from specheads import SpeculativeLM, create_heads
from specheads.heads.cache_keyword import cache_kwargs
from specheads.inference.tree import TreeBuffers, build_tree_buffers

# --- targets, prompts and heads shared by the generate tests ------------------------------------------------
TARGETS = ["stories260K", "llama", "qwen2", "mistral"]  # tiny Mistral: window 4096, never reached
TINY_PROMPT = [1, 5, 9, 33, 7]
EAGLE_SMALL_TREE = dict(tree_depth=4, tree_top_k=3, tree_num_nodes=10)


@pytest.fixture(scope="module", params=TARGETS)
def target_and_prompt(request, stories260k, tiny_target_factory):
    """(target, prompt ids (1, n)) for the embedded stories260K and each tiny random family."""
    if request.param == "stories260K":
        target, tokenizer = stories260k
        return target, tokenizer("Once upon a time", return_tensors="pt").input_ids
    return tiny_target_factory(request.param), torch.tensor([TINY_PROMPT])


def make_heads(target: PreTrainedModel, head_type: str):
    """Fresh heads (seed 0); EAGLE heads with a small tree."""
    torch.manual_seed(0)
    return create_heads(target, head_type, **(EAGLE_SMALL_TREE if head_type == "eagle" else {}))


def speculative_on_a_copy(target: PreTrainedModel, head_type: str) -> SpeculativeLM:
    """A SpeculativeLM over a deep copy of `target` (for tests that swap its layers in place) and fresh heads."""
    target = copy.deepcopy(target)
    return SpeculativeLM(target, make_heads(target, head_type))


def hf_greedy(target: PreTrainedModel, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The reference: transformers' own greedy generate."""
    return target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, width) ids and their attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


class SumModuloBan(LogitsProcessor):
    """A caller's logits processor whose effect depends on the whole sequence: it bans the tokens t with
    (t + sum(input_ids)) % modulus == 0, so every tree node needs its own path (a pure function of input_ids)."""

    def __init__(self, modulus: int = 3) -> None:
        self.modulus = modulus

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        state = input_ids.sum(dim=1, keepdim=True) % self.modulus  # (R, 1)
        tokens = torch.arange(scores.shape[1], device=scores.device)  # (V,)
        return scores.masked_fill((tokens[None] + state) % self.modulus == 0, -float("inf"))


def last_token_rule(batch_id: int, sequence: torch.Tensor) -> list[int]:
    """A `prefix_allowed_tokens_fn` for vocabularies of at least 97 tokens: after token x, only tokens whose
    difference from x is not a multiple of 4 (x itself banned: no immediate repeats)."""
    last = int(sequence[-1])
    return [t for t in range(97) if (t - last) % 4 != 0]


# --- reference greedy decoding ---------------------------------------------------------------------------
@torch.no_grad()
def greedy_continuation(target: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """The target's greedy continuation of `prompt`, one token per forward, ignoring EOS (a plain KV-cache loop)."""
    cache = DynamicCache()
    logits = target(input_ids=torch.tensor([prompt]), **cache_kwargs(target, cache), use_cache=True).logits
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        logits = target(input_ids=torch.tensor([[tokens[-1]]]), **cache_kwargs(target, cache), use_cache=True).logits
    return tokens


@pytest.fixture(scope="session")
def greedy_reference():
    """`greedy_reference(target, prompt_ids, num_tokens)` -> the target's greedy continuation (list of ids)."""
    return greedy_continuation


# --- an oracle drafter -------------------------------------------------------------------------------------
class OracleDrafter:
    """A drafter (the `reset` / `propose` interface of inference/drafting.py) that knows the greedy answer.

    It proposes the reference continuation as a main chain of `depth` tokens, corrupting each position with
    probability `corruption_rate` (seeded). Below a corrupted node the chain goes on, so everything deeper is
    rejected; with probability `rescue_rate` a later sibling carries the true token and the chain continues
    under it instead (the accepted path then skips nodes: KV compaction must gather). Wrong decoy leaves are
    added as siblings with probability `decoy_rate`. With `cycle_rejections`, round r also corrupts depth
    1 + r % (depth + 1) (none when that exceeds `depth`), so every rejection depth is hit within depth + 1 rounds.

    It counts committed tokens (`sum(len(next_tokens))`) to know where the root sits in the reference, and
    records per round the number of drafted tokens that a correct greedy acceptance must keep
    (`expected_accepts`) and the number the engine actually kept (`accepted`, known at the next call).
    """

    def __init__(
        self,
        reference: list[int],
        vocab_size: int,
        depth: int = 5,
        corruption_rate: float = 0.3,
        rescue_rate: float = 0.5,
        decoy_rate: float = 0.5,
        cycle_rejections: bool = False,
        seed: int = 0,
    ) -> None:
        self.reference = reference  # prompt + greedy continuation, long enough to cover every draft
        self.vocab_size = vocab_size
        self.depth = depth
        self.corruption_rate, self.rescue_rate, self.decoy_rate = corruption_rate, rescue_rate, decoy_rate
        self.cycle_rejections = cycle_rejections
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.rng = random.Random(self.seed)
        self.committed = 0  # tokens committed so far; the root is reference[committed]
        self.roots: list[int] = []  # reference position of each round's root
        self.expected_accepts: list[int] = []
        self.accepted: list[int] = []
        self.rescued_rounds = 0  # rounds whose correct path goes through a non-first sibling

    def _wrong(self, token: int) -> int:
        return (token + self.rng.randrange(1, self.vocab_size)) % self.vocab_size

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        if self.roots:
            self.accepted.append(next_tokens.shape[0] - 1)
        assert features.shape[0] == next_tokens.shape[0], "one feature per committed token"
        self.committed += next_tokens.shape[0]
        root = self.committed
        assert int(next_tokens[-1]) == self.reference[root], "the engine's root left the greedy continuation"
        self.roots.append(root)

        forced = 1 + (len(self.roots) - 1) % (self.depth + 1) if self.cycle_rejections else 0
        tokens, parents = [self.reference[root]], [-1]
        chain_parent, chain_correct, expected, rescued = 0, True, 0, False
        for d in range(1, self.depth + 1):
            true = self.reference[root + d]
            corrupt = self.rng.random() < self.corruption_rate or d == forced
            tokens.append(self._wrong(true) if corrupt else true)
            parents.append(chain_parent)
            next_parent = len(tokens) - 1
            if corrupt and self.rng.random() < self.rescue_rate:
                tokens.append(true)  # a later sibling holds the right token; the chain goes on under it
                parents.append(chain_parent)
                next_parent, corrupt = len(tokens) - 1, False
                rescued = rescued or chain_correct
            if self.rng.random() < self.decoy_rate:
                tokens.append(self._wrong(true))  # a wrong leaf
                parents.append(chain_parent)
            chain_correct = chain_correct and not corrupt
            expected += chain_correct
            chain_parent = next_parent
        self.expected_accepts.append(expected)
        self.rescued_rounds += rescued
        return torch.tensor(tokens), build_tree_buffers(torch.tensor(parents))

    def check_accepted(self) -> None:
        """Every finished round accepted exactly the longest correct drafted prefix."""
        assert self.accepted == self.expected_accepts[: len(self.accepted)]


@pytest.fixture(scope="session")
def oracle_drafter():
    """The `OracleDrafter` class (see its docstring)."""
    return OracleDrafter


# --- chi-square goodness of fit ----------------------------------------------------------------------------
# Upper 0.1% points of the chi-square distribution (statistical tables), by degrees of freedom.
# fmt: off
CHI2_CRITICAL_P001 = {
    1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877,
    10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697, 16: 39.252, 17: 40.790,
    18: 42.312, 19: 43.820, 20: 45.315, 25: 52.620, 30: 59.703, 40: 73.402, 50: 86.661, 60: 99.607,
    80: 124.839, 100: 149.449,
}
# fmt: on


def chi2_critical_p001(dof: int) -> float:
    """Chi-square critical value at p = 0.001: the table where it has `dof`, else Wilson-Hilferty (<0.5% off)."""
    if dof in CHI2_CRITICAL_P001:
        return CHI2_CRITICAL_P001[dof]
    z = 3.090232  # standard normal upper 0.1% point
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    dof: int
    critical: float  # at p = 0.001
    bins: int

    @property
    def passed(self) -> bool:
        return self.statistic < self.critical


def chi_square_test(samples: list, probs: dict, min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson's chi-square of `samples` against the exact distribution `probs` (outcome -> probability).

    Outcomes whose expected count is below `min_expected` are pooled into one bin (merged with the next
    smallest bin while the pool is still below `min_expected`). A sample outside the support (probability 0,
    or not in `probs`) makes the statistic infinite.
    """
    total = sum(probs.values())
    assert abs(total - 1) < 1e-4, f"probabilities sum to {total}"
    counts = Counter(samples)
    n = len(samples)
    if any(probs.get(outcome, 0.0) <= 0 for outcome in counts):
        return ChiSquareResult(math.inf, 1, chi2_critical_p001(1), 0)
    bins = sorted(((n * p, counts.get(outcome, 0)) for outcome, p in probs.items() if p > 0), reverse=True)
    merged: list[tuple[float, int]] = []
    pool_expected, pool_observed = 0.0, 0
    for expected, observed in bins:
        if expected >= min_expected:
            merged.append((expected, observed))
        else:
            pool_expected, pool_observed = pool_expected + expected, pool_observed + observed
    while pool_expected > 0 and pool_expected < min_expected and merged:
        expected, observed = merged.pop()  # the smallest remaining bin
        pool_expected, pool_observed = pool_expected + expected, pool_observed + observed
    if pool_expected > 0:
        merged.append((pool_expected, pool_observed))
    statistic = sum((observed - expected) ** 2 / expected for expected, observed in merged)
    dof = max(len(merged) - 1, 1)
    return ChiSquareResult(statistic, dof, chi2_critical_p001(dof), len(merged))


@pytest.fixture(scope="session")
def chi_square():
    """`chi_square(samples, probs)` -> `ChiSquareResult` (statistic, dof, critical at p=0.001, passed)."""
    return chi_square_test


def sharpen_attention(heads):
    """EAGLE / EAGLE-3 heads whose attention is far from uniform (so positions, masks and cache slots matter)."""
    with torch.no_grad():
        attention = heads.layer.self_attn
        attention.q_proj.weight.mul_(20.0)
        attention.k_proj.weight.mul_(20.0)
        attention.v_proj.weight.mul_(10.0)
    return heads.eval()


def load_sampling_harness(alias: str) -> ModuleType:
    """The chi-square harness of test_generate_sampling.py (ExactLaw, sample_first_three, ...) for another test module:
    a sibling test module is loaded by path, under its own `alias`."""
    path = Path(__file__).with_name("test_generate_sampling.py")
    # in this package, so that its own `from .conftest import ...` resolves
    spec = importlib.util.spec_from_file_location(f"{__name__.rpartition('.')[0]}.{alias}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_tree_sizes(lm) -> list[int]:
    """Node counts of the trees `lm`'s drafter proposes from now on (the grafted ones included)."""
    sizes: list[int] = []
    propose = lm.drafter.propose

    def recording(*args):
        tokens, tree = propose(*args)
        sizes.append(tree.num_nodes)
        return tokens, tree

    lm.drafter.propose = recording
    return sizes


def join_streamed_calls(pieces: list) -> list[tuple[str, str, str]]:
    """Streamed tool-call pieces (chat chunks' `delta.tool_calls` entries, or `CallDelta`s) joined as a client joins
    them: (id, name, arguments) per call index; a call's first piece (with its id and name) comes in index order."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        piece = piece if isinstance(piece, dict) else piece.body()
        if "id" in piece:
            assert piece["index"] == len(calls) and piece["type"] == "function", piece
            calls[piece["index"]] = [piece["id"], piece["function"]["name"], ""]
        calls[piece["index"]][2] += piece["function"]["arguments"]
    return [tuple(call) for call in calls.values()]
