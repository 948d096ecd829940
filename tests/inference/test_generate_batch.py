"""Batches of left-padded prompts, and the errors a user can cause (each names the offending value)."""

from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

from specheads import SpeculativeLM, create_heads
from specheads.inference.tree import chain_tree

PROMPTS = ["Once upon a time", "The dog", "Lily and Tom went to the park to play with"]
PAD = 0


@pytest.fixture(scope="module")
def batch(stories260k):
    """(input_ids (3, n), attention_mask (3, n), [prompt ids (1, n_i)]): three prompts of different lengths, left-padded."""
    _, tokenizer = stories260k
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    width = max(p.shape[1] for p in prompts)
    assert len({p.shape[1] for p in prompts}) == 3, "the prompts must differ in length"
    input_ids = torch.full((3, width), PAD, dtype=torch.long)
    attention_mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - p.shape[1] :] = p[0]
        attention_mask[i, width - p.shape[1] :] = 1
    return input_ids, attention_mask, prompts


def make_lm(target, head_type: str) -> SpeculativeLM:
    torch.manual_seed(0)
    options = dict(tree_depth=4, tree_top_k=3, tree_num_nodes=10) if head_type == "eagle" else {}
    return SpeculativeLM(target, create_heads(target, head_type, **options))


@pytest.mark.parametrize("head_type", ["medusa", "eagle"])
def test_each_row_gets_what_it_gets_alone(stories260k, batch, head_type):
    """Row i of a left-padded batch = generate(prompt i) alone = target.generate(prompt i) alone."""
    target, _ = stories260k
    input_ids, attention_mask, prompts = batch
    lm = make_lm(target, head_type)
    out = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20)
    batch_stats = lm.last_stats
    assert out.shape == (3, input_ids.shape[1] + 20)
    assert torch.equal(
        out[:, : input_ids.shape[1]], input_ids
    )  # the prompt and its padding come back as given
    solo_new_tokens = 0
    for i, prompt in enumerate(prompts):
        alone = lm.generate(prompt, max_new_tokens=20)
        solo_new_tokens += lm.last_stats["new_tokens"]
        hf = target.generate(prompt, max_new_tokens=20, do_sample=False)
        assert torch.equal(alone, hf)
        assert torch.equal(out[i, input_ids.shape[1] :], hf[0, prompt.shape[1] :]), f"row {i}"
    assert batch_stats["new_tokens"] == solo_new_tokens == 60


def test_rows_stopping_at_eos_are_right_padded(stories260k, batch):
    """A row that hits EOS early is padded with pad_token_id after its EOS, like transformers' batches."""
    target, _ = stories260k
    input_ids, attention_mask, prompts = batch
    n = input_ids.shape[1]
    lm = make_lm(target, "medusa")
    free = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, eos_token_id=[])
    eos = int(free[1, n + 4])  # row 1's fifth new token
    out = lm.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=PAD
    )
    assert out.shape[0] == 3 and out.shape[1] <= n + 20
    for i, prompt in enumerate(prompts):
        hf = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos)[
            0, prompt.shape[1] :
        ]
        row = out[i, n:]
        assert torch.equal(row[: hf.shape[0]], hf), f"row {i}"
        assert bool((row[hf.shape[0] :] == PAD).all()), f"row {i} padding"
    row1 = out[1, n:].tolist()
    assert row1[: row1.index(eos) + 1] == free[1, n : n + 5].tolist()


def test_all_rows_stopping_early_give_a_narrower_output(stories260k, batch):
    """When every row stops at EOS, the output is only as wide as the longest row (as transformers does)."""
    target, _ = stories260k
    input_ids, attention_mask, prompts = batch
    lm = make_lm(target, "eagle")
    free = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, eos_token_id=[])
    n = input_ids.shape[1]
    eos = [int(free[i, n + 2 + i]) for i in range(3)]  # row i can stop at its (3 + i)-th token at the latest
    out = lm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, eos_token_id=eos)
    assert out.shape[1] < n + 12
    assert out.shape[1] == max(len(row) for row in stopped_rows(free[:, n:].tolist(), set(eos))) + n


def stopped_rows(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    cut = []
    for row in rows:
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        cut.append(row[:end])
    return cut


def test_padded_single_prompt_equals_the_unpadded_one(stories260k):
    """Left padding with an attention mask is invisible, also for a batch of one."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    padded = torch.cat([torch.full((1, 3), PAD), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    lm = make_lm(target, "eagle")
    out = lm.generate(padded, attention_mask=mask, max_new_tokens=15)
    assert torch.equal(out[:, :3], padded[:, :3])
    assert torch.equal(out[:, 3:], lm.generate(ids, max_new_tokens=15))


@pytest.mark.parametrize("head_type", ["medusa", "eagle"])
def test_generation_up_to_the_context_limit(stories260k, head_type):
    """prompt + max_new_tokens == max_position_embeddings (512) is allowed and still exact (drafts may go past it)."""
    target, _ = stories260k
    prompt = torch.randint(3, 512, (1, 495), generator=torch.Generator().manual_seed(0))
    out = make_lm(target, head_type).generate(prompt, max_new_tokens=17)
    assert out.shape == (1, 512)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=17, do_sample=False))


def test_default_padding_with_an_eos_list_matches_transformers(stories260k):
    """Without pad_token_id, rows that stopped early are padded as transformers pads them: with the first EOS."""
    target, _ = stories260k
    prompts = torch.tensor([[1, 403, 407, 261, 378], [1, 403, 407, 261, 300]])
    free = target.generate(prompts[:1], max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    eos = [
        max(free[7], free[2]),
        min(free[7], free[2]),
    ]  # row 0 stops at the second one, which is the smaller id
    assert free.index(eos[1]) < free.index(eos[0])
    expected = target.generate(prompts, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert torch.equal(
        make_lm(target, "medusa").generate(prompts, max_new_tokens=10, eos_token_id=eos), expected
    )


def test_typical_acceptance_runs_and_stays_in_vocabulary(stories260k):
    """Opt-in typical acceptance (lossy) samples valid tokens of the requested length."""
    target, tokenizer = stories260k
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    lm = make_lm(target, "medusa")
    torch.manual_seed(0)
    out = lm.generate(ids, max_new_tokens=15, do_sample=True, acceptance="typical", eos_token_id=[])
    assert out.shape == (1, ids.shape[1] + 15)
    assert bool(((out >= 0) & (out < 512)).all())


# --- errors a user can cause ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(stories260k):
    return make_lm(stories260k[0], "eagle")


PROMPT = torch.tensor([[1, 403, 407, 261, 378]])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "prompt 0 is empty"),
        (
            dict(input_ids=PROMPT.repeat(2, 1), attention_mask=torch.tensor([[1] * 5, [0] * 5])),
            ValueError,
            "prompt 1 is empty",
        ),
        (dict(input_ids=torch.tensor([[1, 600, 5]])), ValueError, r"\[600\].*\[0, 512\)"),
        (dict(input_ids=torch.tensor([[1, -3, 5]])), ValueError, r"\[-3\].*vocabulary"),
        (
            dict(input_ids=PROMPT, max_new_tokens=600),
            ValueError,
            "length 5 \\+ max_new_tokens 600 = 605.*512",
        ),
        (dict(input_ids=PROMPT, max_new_tokens=-1), ValueError, "max_new_tokens=-1"),
        (dict(input_ids=PROMPT, max_new_tokens=2.5), ValueError, "max_new_tokens=2.5"),
        (dict(input_ids=PROMPT, do_sample=True, temperature=0.0), ValueError, "temperature=0.0"),
        (dict(input_ids=PROMPT, do_sample=True, temperature=-1.0), ValueError, "temperature=-1.0"),
        (dict(input_ids=PROMPT, do_sample=True, top_p=1.5), ValueError, "top_p=1.5"),
        (dict(input_ids=PROMPT, do_sample=True, top_k=-2), ValueError, "top_k=-2"),
        (dict(input_ids=PROMPT, acceptance="bogus"), ValueError, "acceptance='bogus'"),
        (dict(input_ids=PROMPT, acceptance="typical"), ValueError, "typical"),
        (
            dict(input_ids=PROMPT.repeat(2, 1), attention_mask=torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])),
            ValueError,
            "prompt 1 is not left-padded",
        ),
        (
            dict(input_ids=PROMPT, attention_mask=torch.ones(1, 4, dtype=torch.long)),
            ValueError,
            r"\(1, 4\).*\(1, 5\)",
        ),
        (dict(input_ids=PROMPT.float()), TypeError, "torch.float32"),
        (dict(input_ids=[[1, 2, 3]]), TypeError, "list"),
        (dict(input_ids=torch.zeros(1, 2, 3, dtype=torch.long)), ValueError, r"\(1, 2, 3\)"),
    ],
)
def test_bad_generate_arguments_raise_clear_errors(lm, kwargs, error, match):
    """Each mistake raises ValueError / TypeError naming the offending value."""
    with pytest.raises(error, match=match):
        lm.generate(**kwargs)


def test_streamer_with_a_batch_raises(lm, stories260k):
    """Streamers take one sequence (as in transformers): a batch of 2 is refused before anything is streamed."""
    streamer = TextStreamer(stories260k[1])
    with pytest.raises(ValueError, match="batch size 1"):
        lm.generate(PROMPT.repeat(2, 1), streamer=streamer)
    assert streamer.token_cache == [] and streamer.next_tokens_are_prompt


def test_bad_constructor_arguments_raise_clear_errors(stories260k):
    """Wrong heads object, a static tree for EAGLE, a tree deeper than the Medusa heads."""
    target, _ = stories260k
    with pytest.raises(TypeError, match="Linear"):
        SpeculativeLM(target, torch.nn.Linear(2, 2))
    eagle = create_heads(target, "eagle")
    with pytest.raises(ValueError, match="tree_depth"):
        SpeculativeLM(target, eagle, tree="medusa_small")
    medusa = create_heads(target, "medusa", num_heads=3)
    with pytest.raises(ValueError, match="depth 5.*3 heads"):
        SpeculativeLM(target, medusa, tree="medusa_default")  # asked for explicitly: depth 5 > 3 heads
    with pytest.raises(ValueError, match="no_such_tree"):
        SpeculativeLM(target, medusa, tree="no_such_tree")
    assert SpeculativeLM(target, medusa, tree=chain_tree(3)).generate(PROMPT, max_new_tokens=3).shape == (
        1,
        8,
    )


@pytest.mark.parametrize("option", ["tree_depth", "tree_top_k", "tree_num_nodes"])
def test_zero_eagle_tree_options_are_rejected(stories260k, option):
    """An explicit 0 is a user error (the drafter says 'must be >= 1'), not a request for the default."""
    target, _ = stories260k
    with pytest.raises(ValueError, match=f"{option}=0"):
        SpeculativeLM(target, create_heads(target, "eagle"), **{option: 0})
