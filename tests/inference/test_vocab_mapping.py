"""Draft models of another tokenizer (heads/vocab_mapping.py: Token-Level Intersection): the shared tokens are found
across space signs, the committed text reaches the draft model, and outputs stay the target's."""

from __future__ import annotations

import copy
import json
import logging
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specheads import SpeculativeLM
from specheads.heads.draft_model import DraftModelHeads
from specheads.heads.vocab_mapping import VocabMapping, normalized_vocab, space_sign

from .conftest import hf_greedy, load_sampling_harness


def permuted_ids(vocab_size: int, fixed: int, seed: int = 0) -> torch.Tensor:
    """(V,) new id of each old id: the first `fixed` ids stay, the others are shuffled."""
    rest = list(range(fixed, vocab_size))
    random.Random(seed).shuffle(rest)
    return torch.tensor(list(range(fixed)) + rest)


def permute_rows(model, new_id: torch.Tensor):
    """A copy of `model` computing the same function in permuted token ids (embedding and lm_head rows moved)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for weight in {id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}.values():
            moved = torch.empty_like(weight)
            moved[new_id] = weight
            weight.copy_(moved)
    return model


@pytest.fixture(scope="module")
def permuted_stories(stories260k, tmp_path_factory):
    """(folder, model, tokenizer, new_id): stories260K's tokens (all but <unk> <s> </s>) under shuffled ids, and
    stories260K itself with its rows moved to match: another tokenizer of the same strings, the same model in it."""
    target, tokenizer = stories260k
    folder = tmp_path_factory.mktemp("permuted-stories")
    tokenizer.save_pretrained(folder)
    new_id = permuted_ids(512, fixed=3)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {token: int(new_id[i]) for token, i in spec["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    model = permute_rows(target, new_id)
    model.save_pretrained(folder)
    return folder, model, AutoTokenizer.from_pretrained(folder), new_id


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny GPT-2-style (byte-level BPE, 'Ġ' for spaces) tokenizer knowing ' the', ' cat', 'the' and some letters."""
    letters = ["Ġ", "t", "h", "e", "c", "a", "s", "o", "n", "d", "g"]
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("c", "a"), ("ca", "t"), ("Ġ", "cat")]
    vocab = {token: i for i, token in enumerate(["<|endoftext|>", *letters, *("".join(m) for m in merges)])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def test_shared_tokens_are_found_across_space_signs(stories260k):
    """SentencePiece's '▁the' and byte-level BPE's 'Ġthe' are one token; ids map both ways."""
    _, stories = stories260k
    gpt = byte_level_tokenizer()
    assert space_sign(stories) == "▁" and space_sign(gpt) == "Ġ"
    assert " the" in normalized_vocab(stories) and " the" in normalized_vocab(gpt)
    mapping = VocabMapping(stories, gpt, 512, len(gpt))
    shared = dict(zip(mapping.draft_ids.tolist(), mapping.target_ids.tolist()))
    the = stories.convert_tokens_to_ids("▁the")
    assert shared[gpt.convert_tokens_to_ids("Ġthe")] == the
    assert int(mapping.target_to_draft[the]) == gpt.convert_tokens_to_ids("Ġthe")
    # a target token the draft lacks reaches it as its text: ' and' -> Ġ a n d; EOS by role; the rest one for one
    and_token, eos = stories.convert_tokens_to_ids("▁and"), stories.eos_token_id
    assert and_token not in shared.values()
    draft = mapping.to_draft(torch.tensor([the, and_token, eos]))
    assert gpt.convert_ids_to_tokens(draft.tolist()) == ["Ġthe", "Ġ", "a", "n", "d", "<|endoftext|>"]
    with pytest.raises(ValueError, match="shares no token with the target's"):
        VocabMapping(stories, gpt, 512, 1)  # the draft can only draft its id 0, which stories260K lacks


def test_a_permuted_tokenizer_maps_back_to_the_same_model(stories260k, permuted_stories):
    """stories260K drafting for itself through a shuffled tokenizer: every token is shared, and with the mapping right
    in both directions every drafted token of a greedy chain is accepted (one wrong id would cost acceptance)."""
    target, tokenizer = stories260k
    _, model, shuffled, new_id = permuted_stories
    mapping = VocabMapping(tokenizer, shuffled, 512, 512)
    assert mapping.num_shared == 512 and torch.equal(mapping.target_to_draft, new_id)
    heads = DraftModelHeads.around(model, target, name="shuffled", vocab_mapping=mapping)
    lm = SpeculativeLM(target, heads, tree_depth=4, tree_top_k=1, tree_num_nodes=4)
    ids = tokenizer("The little dog", return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=61), hf_greedy(target, ids, 61))
    assert lm.last_stats["rounds"] == 12 and lm.last_stats["accepted_per_depth"] == [1.0] * 4, lm.last_stats
    lm.configure_lookup(4)  # and around prompt lookup, in a left-padded batch
    prompts = [ids[0].tolist(), tokenizer("Tom had a red ball. Tom had a red ball.", return_tensors="pt").input_ids[0].tolist()]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = lm.generate(input_ids, attention_mask=mask, max_new_tokens=20)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out[row, width:], hf_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt):]), row


def test_from_pretrained_maps_a_draft_model_of_another_tokenizer(permuted_stories, caplog):
    """`from_pretrained(draft_model=...)` with other token ids builds the mapping itself and says so."""
    folder, *_ = permuted_stories
    with caplog.at_level(logging.WARNING, logger="specheads.heads.draft_model"):
        lm = SpeculativeLM.from_pretrained("stories260K", draft_model=str(folder))
    assert "has another tokenizer than the target: it drafts the 512 tokens both vocabularies share" in caplog.text
    assert lm.heads.vocab_mapping.num_shared == 512 and lm.tree_description()["shared_vocab"] == 512
    ids = lm.tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert torch.equal(lm.generate(ids, max_new_tokens=30), hf_greedy(lm.target, ids, 30))
    assert lm.last_stats["mean_accepted"] > 3


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=words[0])


def test_sampling_through_a_mapping_follows_the_exact_joint_law(tiny_target_factory, chi_square):
    """A 6-token target and a draft model of a shuffled 6-word vocabulary (the target's rows moved, then perturbed):
    the first 3 sampled tokens follow the exact law (chi-square at p = 0.001)."""
    harness = load_sampling_harness("sampling_harness_vocab_mapping")
    target = copy.deepcopy(tiny_target_factory("llama", seed=1, vocab_size=6, num_hidden_layers=1))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    words = ["a", "b", "c", "d", "e", "f"]
    new_id = torch.tensor([0, 4, 2, 5, 1, 3])
    draft = permute_rows(target, new_id)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.3 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    shuffled = [None] * 6
    for old, new in enumerate(new_id.tolist()):
        shuffled[new] = words[old]
    mapping = VocabMapping(word_tokenizer(words), word_tokenizer(shuffled), 6, 6)
    assert torch.equal(mapping.target_to_draft, new_id)
    sampling = dict(temperature=0.9)
    law = harness.ExactLaw(target, **sampling)
    heads = DraftModelHeads.around(draft, target, name="shuffled", vocab_mapping=mapping)
    lm = SpeculativeLM(target, heads, tree_depth=3, tree_top_k=3, tree_num_nodes=8)
    samples = harness.sample_first_three(lm, 1200, seed=5, **sampling)
    result = chi_square(samples, law.joint())
    assert result.passed and result.dof >= 10, result
    assert lm.accepted_drafts > 0.3 * len(samples)
