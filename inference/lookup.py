"""Prompt lookup as one more branch of the draft tree.

Small chat models repeat their prompt and themselves (lists, code, quoted names, loops). Where the last few
committed tokens occurred earlier in the context, the tokens that followed them there are a free guess of
what follows now: prompt lookup decoding (transformers' `prompt_lookup_num_tokens`). Alone it rarely pays
(a guess is only available in some rounds, and then often wrong after a token or two); next to trained heads
it covers exactly the rounds they miss, long verbatim runs, and costs no model call. `LookupDrafter` wraps
any drafter and grafts the guess onto its tree like a word into a trie: the part the heads already drafted
reuses their nodes, the rest becomes a chain of new nodes. The target verifies the merged tree in the same
forward and the usual rules accept from it, so greedy outputs stay identical and sampling stays exact (both
hold for any tree of deterministic candidates: inference/accept.py). With a `CorpusLookup`
(inference/corpus_lookup.py), the guesses of a store of the target's earlier answers are grafted the same way.
"""

from __future__ import annotations

import torch

from specheads.inference.corpus_gate import CorpusGate
from specheads.inference.corpus_lookup import ANSWER_LEAD, CorpusLookup
from specheads.inference.drafting import Drafter
from specheads.inference.tree import TreeBuffers, append_chain


class NgramIndex:
    """A growing token sequence and, for each n-gram in it, where it last started with a token after it.

    `continuation(k)` matches the sequence's last `max_ngram` tokens, then fewer down to `min_ngram`, against
    earlier positions (the most recent occurrence wins: in loops and lists it is the best predictor) and
    returns the k tokens that followed it (a loop repeated where they run into the suffix). O(max_ngram)
    dictionary updates per token, one lookup per n.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # last_start[n][gram] = start of gram's latest occurrence that has a token after it
        self.last_start: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; each one gives the n-grams ending just before it a (newer) continuation."""
        for token in tokens:
            end = len(self.tokens)
            for n, starts in self.last_start.items():
                if end >= n:
                    starts[tuple(self.tokens[end - n :])] = end - n
            self.tokens.append(token)

    def continuation(self, num_tokens: int) -> list[int]:
        """`num_tokens` tokens that followed the latest earlier occurrence of the longest matching suffix (at least
        `min_ngram` tokens long); [] when no suffix occurred before.

        Where that continuation runs into the suffix itself (a loop shorter than `num_tokens`), it goes on repeating
        the loop: what the matched occurrence predicts for the positions being guessed is the guess itself.
        """
        end = len(self.tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if end < n:
                continue
            start = self.last_start[n].get(tuple(self.tokens[end - n :]))
            if start is not None:
                guess = self.tokens[start + n : start + n + num_tokens]
                period = end - (start + n)  # >= 1: every stored start has a token after its n-gram
                while len(guess) < num_tokens:
                    guess.append(guess[len(guess) - period])
                return guess
        return []


def graft_chains(
    tokens: torch.Tensor, tree: TreeBuffers, chains: list[list[int]]
) -> tuple[torch.Tensor, TreeBuffers, list[list[int]]]:
    """Insert `chains` (each: tokens that would follow the root) into a tree as into a trie, in order.

    Args:
        tokens: (N,) the tree's tokens (node 0 the root); tree: its buffers.
        chains: guessed continuations after the root (a later one reuses the nodes an earlier one added).

    Returns:
        (tokens, tree, chain_nodes): N + m nodes, the same N first, then per chain the part the tree lacked, each new
        node the child of the one before (the inputs themselves when m = 0); chain_nodes[i][j] is the node holding
        chains[i][j]. One read of the tree from the device in all.
    """
    if not chains:
        return tokens, tree, []
    tree_tokens, tree_parents = tokens.tolist(), tree.parents.tolist()
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node; the first one when siblings repeat
    for node in range(len(tree_tokens) - 1, 0, -1):
        children[(tree_parents[node], tree_tokens[node])] = node
    added: list[int] = []
    chain_nodes: list[list[int]] = []
    for chain in chains:
        node, path = 0, []
        while len(path) < len(chain) and (node, chain[len(path)]) in children:
            node = children[(node, chain[len(path)])]
            path.append(node)
        matched = len(path)
        if matched < len(chain):
            tree = append_chain(tree, node, len(chain) - matched)
        for token in chain[matched:]:  # the new nodes, for the chains after this one
            children[(node, token)] = new = len(tree_tokens) + len(added)
            added.append(token)
            node = new
            path.append(node)
        chain_nodes.append(path)
    if not added:
        return tokens, tree, chain_nodes
    return torch.cat([tokens, torch.tensor(added, dtype=tokens.dtype, device=tokens.device)]), tree, chain_nodes


def check_lookup_settings(lookup_tokens: int, lookup_max_ngram: int = 3, lookup_max_tokens: int | None = None,
                          corpus_tokens: int = 8) -> None:
    """Raise a ValueError naming the bad value among `SpeculativeLM`'s prompt-lookup and corpus-lookup settings (the
    CLI calls it before loading any model)."""
    if not isinstance(lookup_tokens, int) or lookup_tokens < 0:
        raise ValueError(f"lookup_tokens={lookup_tokens!r} must be an integer >= 0 (0 = no prompt lookup)")
    if not isinstance(lookup_max_ngram, int) or lookup_max_ngram < 1:
        raise ValueError(f"lookup_max_ngram={lookup_max_ngram!r} must be an integer >= 1")
    if lookup_max_tokens is not None and (
        not isinstance(lookup_max_tokens, int) or lookup_tokens == 0 or lookup_max_tokens < lookup_tokens
    ):
        raise ValueError(
            f"lookup_max_tokens={lookup_max_tokens!r} must be None or an integer >= lookup_tokens={lookup_tokens} "
            "with prompt lookup on (lookup_tokens >= 1)"
        )
    if not isinstance(corpus_tokens, int) or corpus_tokens < 1:
        raise ValueError(f"corpus_tokens={corpus_tokens!r} must be an integer >= 1 (the corpus' guessed nodes per round)")


class LookupDrafter:
    """A drafter whose trees also hold the prompt-lookup guess (see the module docstring).

    Args:
        drafter: the heads' drafter (Medusa, EAGLE, EAGLE-3; any `Drafter`).
        num_tokens: the guess grafted per round, in tokens (its new nodes are verified with the tree).
        max_ngram, min_ngram: suffix lengths matched against the context, longest first (min_ngram default: 2, or
            max_ngram if smaller; single tokens recur too often to guess from).
        corpus: also graft the guesses of this store of the target's answers (shared by forks: what one row's
            answer teaches, the others use) while they earn the corpus' `min_gain` accepted tokens per node in this
            request or after matches of the same length (inference/corpus_gate.py); None = prompt lookup alone.
        corpus_tokens: the corpus' guessed nodes per round, at most.
        max_tokens: with a larger value, the guess grows while the target copies: after a round that accepted a
            whole guess of the current length, the next guess may be twice as long (up to `max_tokens`); any other
            round sets it back to `num_tokens`. Copied passages (code edits, quoted text, repeated lists) then cost
            a round per `max_tokens` tokens instead of per `num_tokens`, while a wrong guess costs at most one round
            of `max_tokens` extra nodes. Default `num_tokens`: a fixed length.

    The context is every token the drafter is told about: the prompt from its second token on (the first has no
    feature before it) and everything generated. `num_tokens` = 0 with a corpus: the corpus' guesses alone.
    """

    def __init__(
        self,
        drafter: Drafter,
        num_tokens: int,
        max_ngram: int = 3,
        min_ngram: int | None = None,
        max_tokens: int | None = None,
        corpus: CorpusLookup | None = None,
        corpus_tokens: int = 8,
    ) -> None:
        if num_tokens < 1 and corpus is None:
            raise ValueError(f"lookup_tokens={num_tokens} must be >= 1 without a corpus (0 turns prompt lookup off)")
        check_lookup_settings(num_tokens, max_ngram, max_tokens, corpus_tokens)
        self.drafter = drafter
        self.corpus, self.corpus_tokens = corpus, corpus_tokens
        self.num_tokens = num_tokens
        self.max_tokens = num_tokens if max_tokens is None else max_tokens
        self.index = NgramIndex(max_ngram, min(2, max_ngram) if min_ngram is None else min_ngram)  # validates them
        self.length = num_tokens  # this round's guess length (grows while whole guesses are accepted)
        self.guess: list[int] = []  # last round's grafted guess
        self.gate = self._new_gate()  # this request's: whether the corpus' guesses pay

    @property
    def max_grafted_nodes(self) -> int:
        """Nodes a round's grafts add to the heads' tree at most (prompt lookup's guess, the corpus' guesses)."""
        return (self.max_tokens if self.num_tokens else 0) + (self.corpus_tokens if self.corpus is not None else 0)

    def reset(self) -> None:
        self.drafter.reset()
        self.index = NgramIndex(self.index.max_ngram, self.index.min_ngram)
        self.length, self.guess = self.num_tokens, []
        self.gate = self._new_gate()

    def _new_gate(self) -> CorpusGate | None:
        return None if self.corpus is None else CorpusGate(self.corpus.min_gain, self.corpus.gain_by_match)

    def around(self, drafter: Drafter) -> LookupDrafter:
        """The same prompt lookup around another drafter (with a fresh context)."""
        grows = self.max_tokens if self.max_tokens != self.num_tokens else None
        return LookupDrafter(drafter, self.num_tokens, self.index.max_ngram, self.index.min_ngram, grows,
                             self.corpus, self.corpus_tokens)

    def fork(self) -> LookupDrafter:
        """An independent drafter for another row of a batch (the inner drafter forked, a fresh context)."""
        return self.around(self.drafter.fork())

    def propose(self, features: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, TreeBuffers]:
        tokens, tree = self.drafter.propose(features, next_tokens)
        accepted = next_tokens.tolist()  # last round's accepted tokens and bonus (the first round: the prompt's)
        self.length = self.next_length(accepted)
        self.index.extend(accepted)  # its last token is this round's root
        self.guess = self.index.continuation(self.length) if self.num_tokens else []
        chains = [self.guess] if self.guess else []
        corpus_chains: list[list[int]] = []
        if self.gate is not None:
            self.gate.observe(accepted[:-1])  # what last round's corpus nodes earned
            match = self.corpus.match(self.index.tokens)
            if match[0] >= self.corpus.min_match and self.gate.admits(match[0]):  # a closed gate counts nothing
                corpus_chains = self.corpus.guesses_after(match, self.corpus_tokens)
        # into the trie the tree already is: shared prefixes reuse nodes
        grafted, grafted_tree, chain_nodes = graft_chains(tokens, tree, chains + corpus_chains)
        if self.gate is not None:
            # the heads' nodes, then prompt lookup's (its chain's deepest node is its last), then the corpus' own
            first_corpus_node = max(tokens.shape[0], chain_nodes[0][-1] + 1) if self.guess else tokens.shape[0]
            self.gate.grafted_round(corpus_chains, chain_nodes[len(chains) :], first_corpus_node, grafted.shape[0])
        return grafted, grafted_tree

    def remember(self, prompt: torch.Tensor, new_tokens: list[int]) -> None:
        """A finished answer to the (n,) `prompt`: an online corpus learns it, with the prompt's last `ANSWER_LEAD`
        tokens (read only then)."""
        if self.corpus is not None and self.corpus.online_tokens and new_tokens:
            self.corpus.remember(prompt[-ANSWER_LEAD:].tolist() + new_tokens)

    def next_length(self, accepted: list[int]) -> int:
        """This round's guess length: doubled (up to `max_tokens`) when last round's guess was accepted whole
        (`accepted` = the tokens committed since: the accepted path, then the bonus); else `num_tokens`. A guess
        always has the length asked for (`NgramIndex.continuation` repeats loops), so whole means as long as asked."""
        if self.guess and accepted[: len(self.guess)] == self.guess:
            return min(2 * self.length, self.max_tokens)
        return self.num_tokens


PREDICTION_TOKENS, PREDICTION_MAX_TOKENS = 10, 64  # a predicted answer's guess: 10 tokens, growing up to 64


def with_prediction(drafter: Drafter, prediction: list[int]) -> LookupDrafter:
    """`drafter` (a row's, freshly reset) also guessing from `prediction`, the tokens the answer is expected to
    resemble (OpenAI's Predicted Outputs: a file being edited, a previous draft): prompt lookup's index holds them
    before the context, so where the context's last tokens occur in the prediction (and nowhere later), the tokens
    after them there are the guess, grown while the target copies them. A drafter without prompt lookup gets it
    (`PREDICTION_TOKENS`, growing to `PREDICTION_MAX_TOKENS`). Like any guess, it only changes speed."""
    if not isinstance(drafter, LookupDrafter):
        drafter = LookupDrafter(drafter, PREDICTION_TOKENS, max_tokens=PREDICTION_MAX_TOKENS)
    elif not drafter.num_tokens:  # corpus lookup alone: prompt lookup joins it
        drafter = LookupDrafter(drafter.drafter, PREDICTION_TOKENS, max_tokens=PREDICTION_MAX_TOKENS,
                                corpus=drafter.corpus, corpus_tokens=drafter.corpus_tokens)
    drafter.index.extend(prediction)
    return drafter
