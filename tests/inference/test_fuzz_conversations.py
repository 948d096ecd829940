"""Fuzzing conversations on the static fast path (run eagerly on the CPU), as `serve` runs them on a GPU: several
`PromptCache`s take turns on one `SpeculativeLM`, so each turn may find the runner's static cache written over by
another conversation (its kept copy is restored), grown into a larger runner (its entries carried over), or still
holding its own entries (used in place). Turns continue a conversation, edit it back to any earlier point, or ask
again; each call draws the padded prompt forward on or off and, for EAGLE-3 heads, whole-round graphs on or off.

Drafters: a copy of the target (every draft accepted: long paths compacted in the static cache), its first layer
(some accepted) and untrained EAGLE-3 heads (nearly none). Every output must equal the target's own greedy
`generate` on the whole conversation (EOS drawn inside the answer or none), and every turn must reuse exactly the
prefix it shares with what its cache held.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specheads import SpeculativeLM, create_heads
from specheads.heads.draft_model import DraftModelHeads, early_exit_model
from specheads.inference.prompt_cache import PromptCache, shared_prefix_length

from ..conftest import build_tiny_target
from .conftest import hf_greedy

VOCAB = 97
MAX_CONVERSATION = 150  # tokens; the tiny target places at most 256 positions
CONVERSATIONS = 3


@pytest.fixture(scope="module")
def lms():
    target = build_tiny_target("llama", seed=5)
    return target, {
        "copy": SpeculativeLM(target, DraftModelHeads.around(copy.deepcopy(target), target, name="copy"),
                              tree_depth=4, tree_top_k=2, tree_num_nodes=8),
        "early_exit": SpeculativeLM(target, DraftModelHeads.around(early_exit_model(target, 1), target),
                                    tree_depth=3, tree_top_k=2, tree_num_nodes=6),
        "eagle3": SpeculativeLM(target, create_heads(target, "eagle3", tree_depth=3, tree_top_k=2,
                                                     tree_num_nodes=5)),
    }


turn_strategy = st.tuples(
    st.integers(0, CONVERSATIONS - 1),  # which conversation speaks
    st.sampled_from(["continue", "edit", "again"]),
    st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=6),  # the new user tokens
    st.integers(1, 24),  # max_new_tokens
    st.booleans(),  # graphed prefill (padded prompt forward) on or off
    st.booleans(),  # whole-round graphs on or off (EAGLE-3 heads)
    st.one_of(st.none(), st.integers(0, 23)),  # EOS: the answer's token at this index (if it has one), or none
    st.floats(0, 1),  # where an edit cuts the conversation
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drafter=st.sampled_from(["copy", "early_exit", "eagle3"]),
       turns=st.lists(turn_strategy, min_size=2, max_size=7))
def test_interleaved_conversations_on_the_fast_path_equal_generate(lms, drafter, turns):
    target, by_drafter = lms
    lm = by_drafter[drafter]
    caches = [PromptCache() for _ in range(CONVERSATIONS)]
    last_prompt: list[torch.Tensor | None] = [None] * CONVERSATIONS
    last_output: list[torch.Tensor | None] = [None] * CONVERSATIONS
    try:
        for number, (who, action, new_tokens, max_new, padded, whole_rounds, eos_index, cut) in enumerate(turns):
            follow = torch.tensor([new_tokens])
            if last_output[who] is None or action == "continue":
                ids = follow if last_output[who] is None else torch.cat([last_output[who], follow], dim=1)
            elif action == "edit":  # back to an earlier point of the conversation, then other tokens
                keep = 1 + int(cut * (last_output[who].shape[1] - 1))
                ids = torch.cat([last_output[who][:, :keep], follow], dim=1)
            else:  # the same prompt again (a regenerated answer)
                ids = last_prompt[who]
            if ids.shape[1] + max_new > MAX_CONVERSATION:  # a fresh conversation instead
                caches[who].reset()
                ids = follow
            eos = None
            if eos_index is not None:
                answer = hf_greedy(target, ids, max_new)[0, ids.shape[1]:]
                eos = int(answer[min(eos_index, answer.shape[0] - 1)])
            held = caches[who].tokens
            expected_reuse = 0 if held is None else shared_prefix_length(held, ids[0])
            lm.graphed_prefill, lm.graphed_rounds = padded, whole_rounds
            out = lm.generate(ids, max_new_tokens=max_new, prompt_cache=caches[who], fast_path=True,
                              eos_token_id=eos)
            context = f"turn {number}: conversation {who}, {action}, {ids.shape[1]} prompt tokens, eos {eos}"
            assert torch.equal(out, hf_greedy(target, ids, max_new, eos_token_id=eos)), context
            assert lm.last_stats["fast_path"], context
            assert lm.last_stats["reused_prompt_tokens"] == expected_reuse, context
            last_prompt[who], last_output[who] = ids, out
    finally:
        lm.graphed_prefill = lm.graphed_rounds = None
