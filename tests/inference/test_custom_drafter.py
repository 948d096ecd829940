"""Your own drafter (`SpeculativeLM.use_drafter`): any object with the `Drafter` protocol drafts, and its trees are
verified as the heads' are: the target's output, alone, in batches and with prompt lookup grafted on."""

from __future__ import annotations

import torch

from specheads import SpeculativeLM, create_heads
from specheads.inference.tree import TreeBuffers, build_tree_buffers, tree_spec

from .conftest import hf_greedy, left_pad


class BigramDrafter:
    """A chain of `length` tokens from a bigram table of the sequence so far (the last token that followed the
    current one), plus each chain node's second guess as a sibling: the protocol's four methods, nothing more."""

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.calls = 0

    def reset(self) -> None:
        self.following: dict[int, int] = {}
        self.previous: int | None = None

    def begin(self, first_token: torch.Tensor) -> None:
        self.previous = int(first_token)  # the prompt's first token: its successor is in the first `propose`

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        self.calls += 1
        for token in next_tokens.tolist():
            if self.previous is not None:
                self.following[self.previous] = token
            self.previous = token
        tokens, parents, last, parent = [int(next_tokens[-1])], [-1], int(next_tokens[-1]), 0
        for _ in range(self.length):
            guess = self.following.get(last, 0)
            tokens += [guess, (guess + 1) % 97]
            parents += [parent, parent]
            parent, last = len(tokens) - 2, guess
        return torch.tensor(tokens), build_tree_buffers(torch.tensor(parents))


def test_your_own_drafter_drafts_exactly(tiny_target_factory):
    target = tiny_target_factory("llama")
    lm = SpeculativeLM(target, create_heads(target, "eagle"))
    drafter = BigramDrafter()
    lm.use_drafter(drafter)
    assert lm.tree_description() == {"kind": "custom", "drafter": "BigramDrafter", "lookup_tokens": 0}
    assert tree_spec(lm.tree_description()) == "custom drafter BigramDrafter"
    prompts = [[1, 5, 9, 33, 7, 5, 9, 33], [2, 40, 41, 40, 41]]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        assert torch.equal(lm.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert drafter.calls > 0 and drafter.following  # it drafted, and `begin` gave it the first token
    input_ids, mask = left_pad(prompts)  # no fork(): the batch runs row by row
    out = lm.generate(input_ids, attention_mask=mask, max_new_tokens=20)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out[row, input_ids.shape[1]:], hf_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt):])
    lm.configure_lookup(4)  # prompt lookup grafted onto its trees; use_drafter keeps it
    lm.use_drafter(BigramDrafter(2))
    assert lm.tree_description()["lookup_tokens"] == 4 and lm.tree_description()["kind"] == "custom"
    ids = torch.tensor([prompts[0]])
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(target, ids, 30))
    lm.configure_tree()  # the heads' drafter again
    assert lm.tree_description()["kind"] == "dynamic"
