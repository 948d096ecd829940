"""Regex / JSON-schema constraints (inference/constraints.py): one processor serves token trees and transformers'
`generate` alike, and the two give the same tokens, inside the constraint.

The adapter's bookkeeping is tested on a table-driven index; the rest on outlines-core's own `Index` (the
`constraints` extra, installed with `dev`): a tiny target over a made-up letter vocabulary (oracle drafts: long
accepted paths, rejections at every depth, EOS inside an accepted path) and stories260K's sentencepiece tokenizer
with a JSON schema.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference.constraints import (
    IndexConstraint,
    json_schema_constraint,
    outlines_vocabulary,
    regex_constraint,
    require_outlines_core,
)

from .conftest import hf_greedy, make_heads


class TableIndex:
    """An index from a transition table {(state, token): next state}; `final` states allow EOS only."""

    def __init__(self, table: dict[tuple[int, int], int], final: set[int], eos: int) -> None:
        self.table, self.final, self.eos = table, final, eos

    def get_initial_state(self) -> int:
        return 0

    def get_next_state(self, state: int, token: int) -> int | None:
        return self.table.get((state, token))

    def get_allowed_tokens(self, state: int) -> list[int]:
        return [self.eos] if state in self.final else [t for (s, t) in self.table if s == state]


def test_states_follow_parents_and_prompts_start_over():
    index = TableIndex({(0, 1): 1, (0, 2): 1, (1, 3): 2}, final={2}, eos=9)
    constraint = IndexConstraint(index, eos_token_id=9)
    scores = torch.zeros(4, 10)
    out = constraint(torch.tensor([[5, 5], [5, 6], [7, 7], [4, 4]]), scores)  # four prompts: the initial state
    assert (out.isfinite() == torch.tensor([t in (1, 2) for t in range(10)])).all()
    # the children of prompt [5, 5]: allowed 1 -> state 1, disallowed 4 -> unconstrained, EOS -> unconstrained
    out = constraint(torch.tensor([[5, 5, 1], [5, 5, 4], [5, 5, 9]]), torch.zeros(3, 10))
    assert out[0].isfinite().nonzero().flatten().tolist() == [3]
    assert out[1:].isfinite().all()
    out = constraint(torch.tensor([[5, 5, 1, 3]]), torch.zeros(1, 10))
    assert out[0].isfinite().nonzero().flatten().tolist() == [9]  # the final state: EOS only
    assert constraint.state_of((5, 5, 1, 3)) == 2 and len(constraint.states) == 8  # one entry per sequence seen
    constraint.reset()
    assert constraint.states == {}
    # a token id past the model's vocabulary is dropped; a state with no token left is an error naming it
    narrow = IndexConstraint(TableIndex({(0, 12): 1}, final=set(), eos=9), eos_token_id=9)
    with pytest.raises(ValueError, match=r"allows no token of this vocabulary \(10\) in state 0"):
        narrow(torch.tensor([[1]]), torch.zeros(1, 10))


def test_a_missing_outlines_core_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "outlines_core", None)
    with pytest.raises(ImportError, match=r"pip install 'specheads\[constraints\]'"):
        require_outlines_core()


def chain_index(length: int = 30, eos: int = 96) -> TableIndex:
    """A constraint that forces one token per step (like a JSON key or punctuation, for `length` steps)."""
    return TableIndex({(i, (7 * i + 3) % 90): i + 1 for i in range(length)}, final={length}, eos=eos)


def small_tree_heads(target, head_type: str):
    torch.manual_seed(0)
    if head_type == "medusa":
        return create_heads(target, "medusa", num_heads=4)
    return create_heads(target, head_type, tree_depth=4, tree_top_k=3, tree_num_nodes=10)


@pytest.mark.parametrize("head_type", ["medusa", "eagle", "eagle3"])
def test_heads_draft_what_the_constraint_forces(tiny_target_factory, head_type):
    """Untrained heads draft among the allowed tokens only: where the constraint forces every token, whole drafts
    are accepted (tau near depth + 1, per row and batched) and the output is still `generate`'s."""
    target = tiny_target_factory("llama")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    expected = hf_greedy(target, ids, 40, logits_processor=[IndexConstraint(chain_index(), 96)], eos_token_id=96)
    assert expected[0, ids.shape[1] :].tolist() == [(7 * i + 3) % 90 for i in range(30)] + [96]
    lm = SpeculativeLM(target, small_tree_heads(target, head_type))
    out = lm.generate(ids, max_new_tokens=40, logits_processor=[IndexConstraint(chain_index(), 96)], eos_token_id=96)
    assert torch.equal(out, expected)
    assert lm.last_stats["mean_accepted"] > 3.5  # 31 tokens in 8 forwards or so: every drafted chain accepted
    batch = torch.cat([ids, ids])
    out = lm.generate(batch, max_new_tokens=40, logits_processor=[IndexConstraint(chain_index(), 96)],
                      eos_token_id=96, batched=True)
    assert torch.equal(out, torch.cat([expected, expected])) and lm.last_stats["mean_accepted"] > 3.5
    plain = SpeculativeLM(target, small_tree_heads(target, head_type))
    plain.generate(ids, max_new_tokens=40)
    assert plain.last_stats["mean_accepted"] < 2  # without a constraint the same untrained heads guess badly


def test_drafted_tree_holds_only_allowed_tokens(tiny_target_factory):
    target = tiny_target_factory("qwen2")
    torch.manual_seed(0)
    lm = SpeculativeLM(target, create_heads(target, "eagle3", tree_depth=3, tree_top_k=3, tree_num_nodes=9))
    drafter = lm.drafter
    allowed_tokens = [5, 9, 11, 40, 41]
    mask = torch.zeros(97, dtype=torch.bool)
    mask[allowed_tokens] = True
    seen_depths = []

    def allowed_after(paths: torch.Tensor) -> torch.Tensor:
        seen_depths.append(paths.shape[1])
        return mask.expand(paths.shape[0], -1)

    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = lm.heads.select_features(hidden)[0, :4]  # (4, 3h): the target's fused features of the prompt
    drafter.reset()
    drafter.allowed_after = allowed_after
    tokens, tree = drafter.propose(features, torch.tensor([14, 15, 92, 65]))
    assert set(tokens[1:].tolist()) <= set(allowed_tokens) and tree.num_nodes == 10
    assert seen_depths == [0, 1, 2]  # the root, then each level's frontier paths
    drafter.allowed_after = None
    drafter.reset()
    tokens, _ = drafter.propose(features, torch.tensor([14, 15, 92, 65]))
    assert not set(tokens[1:].tolist()) <= set(allowed_tokens)


def test_medusa_tree_takes_its_choices_among_allowed_tokens(tiny_target_factory):
    """Each node is the choice-th likeliest allowed token of its head: allowed tokens only, siblings distinct, and
    the allowed set may depend on the parent's path (asked once per depth, for that depth's parents)."""
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, small_tree_heads(target, "medusa"))
    drafter = lm.drafter
    tree = drafter.buffers

    def allowed_after(paths: torch.Tensor) -> torch.Tensor:  # after token t, only t + 1 ... t + 12 (mod 97)
        last = paths[:, -1] if paths.shape[1] else torch.full((paths.shape[0],), 50)
        offsets = (torch.arange(97)[None] - last[:, None]) % 97
        return (offsets >= 1) & (offsets <= 12)

    drafter.allowed_after = allowed_after
    features = torch.randn(3, target.config.hidden_size)
    tokens, _ = drafter.propose(features, torch.tensor([7, 8, 50]))
    assert tokens[0] == 50
    for node in range(1, tree.num_nodes):
        parent = int(tree.parents[node])
        assert 1 <= (int(tokens[node]) - int(tokens[parent])) % 97 <= 12, node
    for parent in range(tree.num_nodes):
        siblings = tokens[tree.parents == parent].tolist()
        assert len(siblings) == len(set(siblings)), parent


# --- outlines-core's Index ---------------------------------------------------------------------------------------
LETTERS = "abcde"
EOS = 96
REGEX = "(ab|ba){3,6}c"


def letter_index(regex: str):
    """A tiny target's 97 tokens as text: token i is LETTERS[i % 5] for i < 90, 90 "ab", 91 "ba", 92-95 "cab" etc.;
    96 is EOS."""
    outlines_core = pytest.importorskip("outlines_core")
    texts: dict[str, list[int]] = {}
    for i in range(90):
        texts.setdefault(LETTERS[i % 5], []).append(i)
    for i, text in zip(range(90, 96), ["ab", "ba", "cab", "bab", "aba", "dd"]):
        texts.setdefault(text, []).append(i)
    return outlines_core.Index(regex, outlines_core.Vocabulary(EOS, texts))


def letters(tokens: list[int]) -> str:
    extra = {90: "ab", 91: "ba", 92: "cab", 93: "bab", 94: "aba", 95: "dd"}
    return "".join(extra.get(t, LETTERS[t % 5]) for t in tokens if t != EOS)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_regex_constraint_equals_generate_with_oracle_drafts(tiny_target_factory, oracle_drafter, family):
    target = tiny_target_factory(family)
    index = letter_index(REGEX)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    expected = hf_greedy(target, ids, 40, logits_processor=[IndexConstraint(index, EOS)], eos_token_id=EOS)
    new = expected[0, ids.shape[1] :].tolist()
    assert new[-1] == EOS and re.fullmatch(REGEX, letters(new))  # the constraint ran to its end
    lm = SpeculativeLM(target, make_heads(target, "medusa"))
    lm.drafter = oracle_drafter(expected[0].tolist() + [1] * 8, 97, depth=5, corruption_rate=0.15,
                                cycle_rejections=True, seed=3)
    out = lm.generate(ids, max_new_tokens=40, logits_processor=[IndexConstraint(index, EOS)], eos_token_id=EOS)
    assert torch.equal(out, expected)
    assert lm.last_stats["mean_accepted"] > 2
    # real (untrained) heads with prompt lookup, greedy and sampled: sampled texts match the regex too
    lm = SpeculativeLM(target, make_heads(target, "eagle3"), lookup_tokens=6)
    out = lm.generate(ids, max_new_tokens=40, logits_processor=[IndexConstraint(index, EOS)], eos_token_id=EOS)
    assert torch.equal(out, expected)
    torch.manual_seed(0)
    for _ in range(5):
        sampled = lm.generate(ids, max_new_tokens=40, do_sample=True, temperature=1.5,
                              logits_processor=[IndexConstraint(index, EOS)], eos_token_id=EOS)
        text = letters(sampled[0, ids.shape[1] :].tolist())
        assert re.fullmatch(REGEX, text) or (sampled.shape[1] == ids.shape[1] + 40 and re.match("[ab]*", text))


def test_json_schema_constraint_on_a_sentencepiece_tokenizer(stories260k):
    """stories260K writes JSON valid under a schema, identical to `target.generate` with the same constraint,
    greedy per row and in a batch; the vocabulary keeps sentencepiece's spaces and leaves special tokens out."""
    pytest.importorskip("outlines_core")
    target, tokenizer = stories260k
    vocabulary = outlines_vocabulary(tokenizer)
    assert vocabulary.get(" Once") == [tokenizer.convert_tokens_to_ids("\u2581Once")]
    assert vocabulary.get("<s>") is None and vocabulary.get_eos_token_id() == tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "happy": {"type": "boolean"}},
              "required": ["name", "happy"]}
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    expected = hf_greedy(target, ids, 60, logits_processor=[json_schema_constraint(tokenizer, schema)])
    text = tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    assert expected[0, -1] == tokenizer.eos_token_id, text
    value = json.loads(text)
    assert set(value) == {"name", "happy"} and isinstance(value["happy"], bool)
    for head_type in ("eagle", "eagle3"):
        torch.manual_seed(0)
        lm = SpeculativeLM(target, create_heads(target, head_type), lookup_tokens=8)
        out = lm.generate(ids, max_new_tokens=60, logits_processor=[json_schema_constraint(tokenizer, schema)])
        assert torch.equal(out, expected), head_type


def test_regex_constraint_needs_an_eos(stories260k):
    pytest.importorskip("outlines_core")
    _, tokenizer = stories260k
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="constraints need a tokenizer with an EOS token"):
        regex_constraint(tokenizer, "[a-z]+")
