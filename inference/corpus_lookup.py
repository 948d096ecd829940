"""Corpus lookup: guesses from a store of the target's own earlier answers (REST / SuffixDecoding style).

A chat model says the same things to different people ("Here are some tips to ...", "I hope this helps!"),
word for word, since greedy decoding of the same weights repeats itself. Heads learn the common phrases but
lose confidence a few tokens deep; a store of the target's answers to other prompts remembers them whole.
Each round, the longest suffix of the context (up to `max_match` tokens) is found in the store, and the
continuations that followed its occurrences are counted into a small trie: the continuations at least
`min_probability` of the occurrences agree on become draft nodes (`CorpusLookup.guesses`). `LookupDrafter`
grafts them onto the heads' tree next to prompt lookup's guess, so verification and acceptance are unchanged:
greedy outputs stay identical and sampling stays exact (any tree of deterministic candidates is).

With `online_tokens`, the lookup also learns: every answer the target finishes (`remember`) joins the store of the
latest answers, so traffic that repeats itself (the same task over new inputs, an agent's loop, regenerated
answers) is soon guessed whole; this is SuffixDecoding's global tree. New answers go to a small store rebuilt per
answer; once they hold `SETTLE_TOKENS` tokens (or an eighth of `online_tokens`), the large store of all learned
answers is rebuilt with them, so a busy server rebuilds little per answer (answers past `online_tokens` leave the
large store at its next rebuild).

Guessed nodes cost verification, so they are grafted only where they pay (inference/corpus_gate.py): while the
request's own guesses, or the traffic's guesses after matches of the same length, earn `min_gain` accepted tokens per
node.

A store is a suffix array over the reversed corpus, so the suffixes matching the context's last m tokens form one
range of it that narrows as m grows (one binary search per added token). It is built once (numpy, prefix doubling
up to `max_match` tokens: about 0.5 s for a million tokens on 2 CPU cores).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specheads.atomic_files import staged_file
from specheads.inference.corpus_gate import MIN_GAIN, GainTally

CORPUS_FILE = "lookup_corpus.npy"  # the corpus a heads folder may carry (uint32 token ids, documents apart)
SEPARATOR = -1  # between documents: never matched, never guessed
SAVED_SEPARATOR = np.iinfo(np.uint32).max  # SEPARATOR as the saved uint32 file holds it
ANSWER_LEAD = 3  # prompt tokens kept in front of an answer: a chat template's assistant header, so openings match
SAVE_EVERY = 32  # `--corpus-learned FILE` is written again after this many learned answers (`--corpus-save-every`)
SETTLE_TOKENS = 2048  # learned answers wait in a small store, rebuilt per answer, until they hold this many tokens


def sorted_prefix_order(tokens: np.ndarray, length: int) -> np.ndarray:
    """Start positions of `tokens`' suffixes sorted by their first `length` tokens (prefix doubling).

    Args:
        tokens: (n,) int64; a suffix reaching the end is shorter and sorts before its extensions.
        length: how many leading tokens the order must respect (ties beyond them stay in an unspecified order).

    Returns:
        (n,) int64 positions.
    """
    n = len(tokens)
    _, rank = np.unique(tokens, return_inverse=True)  # dense ranks 0..u-1 by token value
    rank = rank.astype(np.int64) + 1  # 0 is kept for "past the end"
    width = 1
    order = np.argsort(rank, kind="stable")
    while width < length:
        # sort by (rank of the first `width` tokens, rank of the next `width`); both < n + 2
        following = np.zeros(n, dtype=np.int64)
        following[: n - width] = rank[width:]
        key = rank * (n + 2) + following
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[order] = np.concatenate([[1], 1 + np.cumsum(sorted_key[1:] != sorted_key[:-1])])
        rank, width = new_rank, 2 * width
        if rank.max() == n:  # every suffix already distinct
            break
    return order


class SuffixStore:
    """Token documents and the suffix array of their reversed concatenation, for longest-suffix matches.

    Args:
        documents: token id sequences (each ends the matches and continuations that reach it).
        max_match: the suffix array orders suffixes by this many leading tokens: the longest match it can find.
    """

    def __init__(self, documents: Iterable[Sequence[int]], max_match: int) -> None:
        tokens = documents_array(documents)
        self.tokens = tokens if len(tokens) else np.array([SEPARATOR], dtype=np.int64)  # (n,)
        if (self.tokens < SEPARATOR).any():
            raise ValueError(f"corpus token ids must be >= 0, got {int(self.tokens.min())}")
        # reversed_[j] = tokens[n - 1 - j]: a suffix of `reversed_` is the corpus read backwards from a position
        self.reversed_ = self.tokens[::-1].copy()
        self.order = sorted_prefix_order(self.reversed_, max_match)  # (n,)
        self.max_match = max_match

    @property
    def num_tokens(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """The part of order[lo:hi] whose reversed suffix has `token` at `offset` (they agree before it, so the
        part is contiguous): two binary searches."""
        n, reversed_, order = len(self.reversed_), self.reversed_, self.order

        def at(i: int) -> int:
            position = order[i] + offset
            return int(reversed_[position]) if position < n else -2  # past the end sorts first

        low, high = lo, hi
        while low < high:  # first index with value >= token
            mid = (low + high) // 2
            if at(mid) < token:
                low = mid + 1
            else:
                high = mid
        start, high = low, hi
        while low < high:  # first index with value > token
            mid = (low + high) // 2
            if at(mid) <= token:
                low = mid + 1
            else:
                high = mid
        return start, low

    def match(self, context: Sequence[int]) -> tuple[int, int, int]:
        """(lo, hi, m): the longest suffix of `context` found here (m <= max_match tokens) ends where each of
        order[lo:hi] starts in the reversed corpus; m = 0 when not even its last token occurs."""
        lo, hi, matched = 0, len(self.order), 0
        for m in range(1, min(self.max_match, len(context)) + 1):
            new_lo, new_hi = self._narrow(lo, hi, m - 1, int(context[-m]))
            if new_lo == new_hi:
                break
            lo, hi, matched = new_lo, new_hi, m
        return lo, hi, matched

    def continuations(self, lo: int, hi: int, count: int, length: int) -> list[list[int]]:
        """Up to `length` tokens that follow `count` of the matches order[lo:hi] (evenly spread: deterministic),
        each cut at its document's end."""
        matches = hi - lo
        picks = self.order[lo + (np.arange(count) * matches) // count]
        # a match ending at reversed position p (its first token there) ends at original position n - 1 - p:
        # its continuation starts at n - p
        n, out = len(self.tokens), []
        for start in (n - picks).tolist():
            continuation = self.tokens[start : start + length].tolist()
            if SEPARATOR in continuation:
                continuation = continuation[: continuation.index(SEPARATOR)]
            out.append(continuation)
        return out


class CorpusLookup:
    """Guesses of what follows a context, from the continuations of its longest match in a corpus of answers.

    Args:
        documents: the corpus, token id sequences (the target's answers; never the prompts being measured).
        max_match: the longest context suffix matched, in tokens.
        min_match: a shorter match guesses nothing (a token or two is what heads predict best).
        max_occurrences: continuations counted per store and round at most (evenly spread over the matches:
            deterministic).
        min_probability: a guessed node's share of the counted continuations that pass through it, at least.
        online_tokens: learn from finished answers (`remember`), keeping the latest this many tokens of them in a
            second store (0 = the corpus as given).
        min_gain: the guesses are grafted only while they earn at least this many accepted tokens per node they add,
            in the request or after matches of the same length (inference/corpus_gate.py; 0 = always graft).
    """

    def __init__(
        self,
        documents: Iterable[Sequence[int]] = (),
        max_match: int = 16,
        min_match: int = 2,
        max_occurrences: int = 64,
        min_probability: float = 0.3,
        online_tokens: int = 0,
        min_gain: float = MIN_GAIN,
    ) -> None:
        check_corpus_settings(max_match, min_match, max_occurrences, min_probability, online_tokens, min_gain)
        self.max_match, self.min_match, self.min_gain = max_match, min_match, min_gain
        self.max_occurrences, self.min_probability = max_occurrences, min_probability
        self.base = SuffixStore(documents, max_match)
        self.online_tokens = online_tokens
        self.recent: list[list[int]] = []  # the latest remembered answers, oldest first
        self._settled_count = 0  # recent[:count] are in the large store (with answers evicted since its rebuild)
        self._settled_store: SuffixStore | None = None
        self._fresh_store: SuffixStore | None = None  # recent[count:] (None when empty)
        self._stale = False  # answers were remembered since the stores were last built
        # what grafted guesses earned after matches of each length (bit length), over all requests: the gate's
        self.gain_by_match: dict[int, GainTally] = {}
        # `keep_learned_in`: the file `remember` writes the learned answers to, every `save_every` answers
        self.learned_file: Path | None = None
        self.save_every = 0
        self._unsaved = 0  # answers remembered since the last `save_learned`

    @classmethod
    def load(cls, path: str | Path, **settings: Any) -> CorpusLookup:
        """A lookup over the corpus `save` wrote (`CORPUS_FILE` in a heads folder, or the file itself)."""
        return cls(read_corpus_file(path), **settings)

    def save(self, path: str | Path) -> Path:
        """Write the corpus (uint32 token ids, documents apart) to `path` atomically (a folder gets `CORPUS_FILE`);
        returns the file. Remembered answers are not part of it (`save_learned`)."""
        return write_corpus_file(path, self.base.tokens)

    def save_learned(self, path: str | Path) -> Path:
        """Write the remembered answers, oldest first, to the corpus file `path` (atomically), for `load_learned`."""
        self._unsaved = 0
        return write_corpus_file(path, documents_array(self.recent))

    def keep_learned_in(self, path: str | Path, every: int) -> None:
        """Have `remember` write the learned answers to `path` (`save_learned`) after every `every` answers, so that
        a process killed without a clean end loses fewer than `every` of them (0: only when `save_learned` is
        called; the CLI also writes them when the command ends)."""
        check_save_every(every)
        self.learned_file, self.save_every = Path(path), every

    def load_learned(self, path: str | Path) -> None:
        """Remember the answers `save_learned` wrote (a restarted server goes on from what it had learned)."""
        if self.online_tokens <= 0:
            raise ValueError(f"cannot load learned answers from {path} into a corpus that does not learn "
                             "(online_tokens=0; CLI: --corpus-learn N)")
        for answer in read_corpus_file(path):
            self.remember(answer.tolist())

    @property
    def max_token_id(self) -> int:
        """The largest token id of the corpus and the remembered answers (-1 when empty): a target's vocabulary must
        hold it."""
        return max([int(self.base.tokens.max())] + [max(answer) for answer in self.recent if answer])

    @property
    def learned_tokens(self) -> int:
        """Tokens of the remembered answers."""
        return sum(len(answer) for answer in self.recent)

    @property
    def num_tokens(self) -> int:
        """Tokens the guesses read from: the corpus and the remembered answers."""
        return self.base.num_tokens + self.learned_tokens

    def remember(self, answer: Sequence[int]) -> None:
        """Learn a finished answer (with `ANSWER_LEAD` prompt tokens in front: the chat template's assistant header);
        the oldest remembered ones go once they hold more than `online_tokens` tokens. No-op unless online."""
        if self.online_tokens <= 0 or len(answer) == 0:
            return
        self.recent.append([int(t) for t in answer][-self.online_tokens :])
        held = self.learned_tokens
        while held > self.online_tokens:
            held -= len(self.recent.pop(0))
            self._settled_count = max(self._settled_count - 1, 0)  # an evicted settled answer stays until a rebuild
        self._stale = True
        self._unsaved += 1
        if self.learned_file is not None and self.save_every and self._unsaved >= self.save_every:
            self.save_learned(self.learned_file)  # ~7 ms per 100k learned tokens (2 cores): fine once per K answers

    def _stores(self) -> list[SuffixStore]:
        """The stores guesses read: the corpus, the learned answers' large store, the newest answers' small one
        (rebuilt only after `remember`)."""
        if self._stale:
            fresh = self.recent[self._settled_count :]
            if sum(len(a) for a in fresh) >= min(SETTLE_TOKENS, max(self.online_tokens // 8, 1)):
                # settle: one store of every learned answer (~65 ms per 200k tokens on 2 cores), the small one empty
                self._settled_store = SuffixStore(self.recent, self.max_match)
                self._settled_count, fresh = len(self.recent), []
            self._fresh_store = SuffixStore(fresh, self.max_match) if fresh else None
            self._stale = False
        return [store for store in (self.base, self._settled_store, self._fresh_store) if store is not None]

    def guesses(self, context: Sequence[int], max_tokens: int) -> list[list[int]]:
        """Chains of guessed tokens after `context`: the root-to-leaf paths of the trie of counted continuations
        (each node passed by at least `min_probability` of them), at most `max_tokens` nodes in all, likeliest
        first. The store(s) with the longest match are counted; [] when it is shorter than `min_match`."""
        return self.guesses_after(self.match(context), max_tokens)

    def match(self, context: Sequence[int]) -> tuple[int, list[tuple[SuffixStore, int, int]]]:
        """(m, ranges): the longest suffix of `context` found in a store, m tokens, and each store holding it with
        its range of matches (`SuffixStore.match`); what `guesses_after` counts (a gate may look at m first)."""
        matches = [(store, *store.match(context)) for store in self._stores()]
        longest = max(matched for *_, matched in matches)
        return longest, [(store, lo, hi) for store, lo, hi, matched in matches if matched == longest]

    def guesses_after(self, match: tuple[int, list[tuple[SuffixStore, int, int]]], max_tokens: int) -> list[list[int]]:
        """`guesses` from the `match` of the context."""
        longest, ranges = match
        if max_tokens < 1 or longest < self.min_match:
            return []
        continuations: list[list[int]] = []
        for store, lo, hi in ranges:
            continuations += store.continuations(lo, hi, min(hi - lo, self.max_occurrences), max_tokens)
        prefix_counts: Counter[tuple[int, ...]] = Counter()
        for continuation, count in Counter(map(tuple, continuations)).items():  # repeats (learned answers) once
            for length in range(1, len(continuation) + 1):
                prefix_counts[continuation[:length]] += count
        needed = self.min_probability * len(continuations)
        # a prefix counts at least as much as its extensions, and sorts first on ties: kept prefixes form a trie
        kept = sorted((prefix for prefix, count in prefix_counts.items() if count >= needed),
                      key=lambda prefix: (-prefix_counts[prefix], len(prefix)))[:max_tokens]
        inner = {prefix[:length] for prefix in kept for length in range(1, len(prefix))}
        return [list(prefix) for prefix in kept if prefix not in inner]


def documents_array(documents: Iterable[Sequence[int]]) -> np.ndarray:
    """(n,) int64: the documents' token ids, each followed by `SEPARATOR` (empty for no documents)."""
    pieces = [np.append(np.asarray(document, dtype=np.int64).reshape(-1), SEPARATOR) for document in documents]
    return np.concatenate(pieces) if pieces else np.array([], dtype=np.int64)


def read_corpus_file(path: str | Path) -> list[np.ndarray]:
    """The documents of a corpus file (`write_corpus_file`; a folder: its `CORPUS_FILE`), int64 token ids each.

    Raises:
        FileNotFoundError: no such file; ValueError: not a 1-D uint32 .npy.
    """
    path = Path(path)
    if path.is_dir():
        path = path / CORPUS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no lookup corpus at {path} (make one with `specheads data lookup-corpus`)")
    try:
        flat = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise ValueError(f"{path} is not a lookup corpus (a .npy of uint32 token ids): {error}") from error
    if flat.ndim != 1 or flat.dtype != np.uint32:
        raise ValueError(f"{path} holds a {flat.dtype} array of shape {flat.shape}, expected 1-D uint32 token ids")
    flat = flat.astype(np.int64)
    flat[flat == SAVED_SEPARATOR] = SEPARATOR
    pieces = np.split(flat, np.flatnonzero(flat == SEPARATOR) + 1)  # each document with its separator, then the rest
    return [piece[:-1] for piece in pieces[:-1]] + ([pieces[-1]] if len(pieces[-1]) else [])


def write_corpus_file(path: str | Path, tokens: np.ndarray) -> Path:
    """Write (n,) token ids, documents apart (`SEPARATOR`), as uint32 to `path` atomically (a folder gets
    `CORPUS_FILE`); returns the file."""
    path = Path(path)
    if path.is_dir():
        path = path / CORPUS_FILE
    with staged_file(path) as staged, open(staged, "wb") as f:  # np.save(str) would append .npy to other names
        np.save(f, tokens.astype(np.uint32))  # SEPARATOR wraps to SAVED_SEPARATOR
    return path


def answer_spans(input_ids: Sequence[int], loss_mask: Sequence[int], lead: int = ANSWER_LEAD) -> list[list[int]]:
    """The answers of one tokenized conversation (`training.conversations.tokenize_record`: `loss_mask` 1 on assistant
    tokens), each with the `lead` tokens before it (the assistant header), as corpus documents."""
    spans, start = [], None
    for i, trained in enumerate([*loss_mask, 0]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            spans.append([int(t) for t in input_ids[max(start - lead, 0) : i]])
            start = None
    return spans


def corpus_for_target(corpus: CorpusLookup | str | Path, vocab_size: int) -> CorpusLookup:
    """`corpus`, loaded if it is a path, checked against a target's vocabulary of `vocab_size` tokens.

    Raises:
        ValueError: the corpus holds a token id past the vocabulary (it was made with another tokenizer).
    """
    if not isinstance(corpus, CorpusLookup):
        corpus = CorpusLookup.load(corpus)
    if corpus.max_token_id >= vocab_size:
        raise ValueError(f"the lookup corpus holds token id {corpus.max_token_id}, but the target's vocabulary has "
                         f"{vocab_size} tokens: the corpus was made with another tokenizer (make it with "
                         "`specheads data lookup-corpus --target` this target)")
    return corpus


def corpus_from_options(path: str | Path | None, online_tokens: int = 0, min_gain: float = MIN_GAIN,
                        learned_file: str | Path | None = None, save_every: int = SAVE_EVERY) -> CorpusLookup | None:
    """The corpus lookup of the CLI's `--lookup-corpus PATH`, `--corpus-learn N`, `--corpus-min-gain G`,
    `--corpus-learned FILE` and `--corpus-save-every K`: the saved corpus (learning when N > 0), an empty one that
    learns (no path), or None (neither); a learning one first remembers the answers in FILE when it exists
    (`save_learned` wrote them), then writes FILE again every K answers it learns (`keep_learned_in`)."""
    if not isinstance(online_tokens, int) or online_tokens < 0:
        raise ValueError(f"--corpus-learn {online_tokens!r}: expected 0 (off) or a number of tokens")
    if not isinstance(min_gain, (int, float)) or not 0.0 <= min_gain < float("inf"):
        raise ValueError(f"--corpus-min-gain {min_gain!r}: expected a number >= 0 (0 = always graft)")
    check_save_every(save_every)  # before any loading, with or without a learned file
    if learned_file is not None and online_tokens == 0:
        raise ValueError(f"--corpus-learned {learned_file}: keeps what the corpus learns, so it needs --corpus-learn N")
    if learned_file is not None and Path(learned_file).is_dir():
        raise ValueError(f"--corpus-learned {learned_file} is a folder: expected a file (e.g. learned.npy)")
    corpus = None
    if path is not None:
        corpus = CorpusLookup.load(path, online_tokens=online_tokens, min_gain=min_gain)
    elif online_tokens:
        corpus = CorpusLookup(online_tokens=online_tokens, min_gain=min_gain)
    if learned_file is not None:
        if Path(learned_file).exists():
            corpus.load_learned(learned_file)
        corpus.keep_learned_in(learned_file, save_every)
    return corpus


def check_corpus_settings(max_match: int, min_match: int, max_occurrences: int, min_probability: float,
                          online_tokens: int, min_gain: float = MIN_GAIN) -> None:
    """Raise a ValueError naming the bad value among `CorpusLookup`'s settings."""
    if not isinstance(min_match, int) or not isinstance(max_match, int) or not 1 <= min_match <= max_match:
        raise ValueError(f"corpus lookup needs integers 1 <= min_match <= max_match, got min_match={min_match!r}, "
                         f"max_match={max_match!r}")
    if not isinstance(max_occurrences, int) or max_occurrences < 1:
        raise ValueError(f"max_occurrences={max_occurrences!r} must be an integer >= 1")
    if not 0.0 < min_probability <= 1.0:
        raise ValueError(f"min_probability={min_probability!r} must be in (0, 1]")
    if not isinstance(online_tokens, int) or online_tokens < 0:
        raise ValueError(f"online_tokens={online_tokens!r} must be an integer >= 0 (0 = no learning from answers)")
    if not isinstance(min_gain, (int, float)) or not 0.0 <= min_gain < float("inf"):
        raise ValueError(f"min_gain={min_gain!r} must be a number >= 0 (accepted tokens per grafted node; 0 = always "
                         "graft)")


def check_save_every(every: int) -> None:
    """Raise a ValueError naming a bad `--corpus-save-every` / `keep_learned_in` count (0 or more answers)."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"--corpus-save-every {every!r}: expected 0 (only at the end) or a number of answers")
