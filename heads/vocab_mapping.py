"""Draft models of another tokenizer: Token-Level Intersection (TLI; Timor et al., ICML 2025, arXiv 2502.05202).

A draft model whose tokenizer differs from the target's (a Qwen 0.5B drafting for a Llama or a Gemma target) can
still draft: it drafts only tokens that both vocabularies hold (the same string, with each tokenizer's space sign
read as a space), mapped to the target's ids before verification. The target verifies target ids as ever, so the
output is the target's whatever the mapping (greedy identical, sampling exact); the mapping only moves how often
drafts are right. transformers' universal assisted generation and vLLM's heterogeneous-vocabulary drafting use the
same intersection.

The other direction, the committed text into the draft model: a target token both vocabularies hold is its draft
id; one only the target holds is its text re-encoded by the draft tokenizer (cached per id; special tokens map by
role: BOS to BOS, EOS to EOS). Token by token, so where the draft tokenizer would merge across target tokens it sees
a slightly different split of the same text: a cost in acceptance only.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def space_sign(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The character a tokenizer writes for a word-initial space ('▁' SentencePiece, 'Ġ' byte-level BPE), or None."""
    ids = tokenizer(" a", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    first = next((t for t in tokens if t and t.strip()), "")
    return first[0] if first and first[0] in ("▁", "Ġ") else None


def normalized_vocab(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """{token string with its space sign read as ' ': id}; the first id wins where two normalize alike."""
    sign = space_sign(tokenizer)
    vocab: dict[str, int] = {}
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        vocab.setdefault(token.replace(sign, " ") if sign else token, index)
    return vocab


class VocabMapping:
    """The shared tokens of a target's and a draft model's vocabularies, and the committed text's way into the draft.

    Args:
        target_tokenizer, draft_tokenizer: the two tokenizers.
        target_vocab_size: the target's ids are below it (its embedding rows; tokens past it are not shared).
        draft_vocab_size: the draft model's output rows (ids past it cannot be drafted).

    Attributes:
        draft_ids, target_ids: (K,) the shared tokens' ids on each side, by draft id.
        target_to_draft: (V_target,) each target id's draft id, -1 where the token is not shared.
    """

    def __init__(self, target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase,
                 target_vocab_size: int, draft_vocab_size: int) -> None:
        target, draft = normalized_vocab(target_tokenizer), normalized_vocab(draft_tokenizer)
        pairs = sorted((d, target[s]) for s, d in draft.items()
                       if s in target and target[s] < target_vocab_size and d < draft_vocab_size)
        if not pairs:
            raise ValueError(f"the draft model's tokenizer ({len(draft)} tokens) shares no token with the target's "
                             f"({len(target)} tokens): it cannot draft for this target")
        self.draft_ids = torch.tensor([d for d, _ in pairs])
        self.target_ids = torch.tensor([t for _, t in pairs])
        self.target_to_draft = torch.full((target_vocab_size,), -1, dtype=torch.long)
        self.target_to_draft[self.target_ids] = self.draft_ids
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_space_sign = space_sign(target_tokenizer)
        self._translations: dict[int, list[int]] = {}  # unshared target id -> its draft ids
        self.target_vocab_size = target_vocab_size
        logger.info("draft model vocabulary: %d of the target's %d tokens shared", len(pairs), target_vocab_size)

    @property
    def num_shared(self) -> int:
        return int(self.draft_ids.shape[0])

    def to(self, device: torch.device | str) -> VocabMapping:
        """The id tables on `device` (in place; returns self)."""
        self.draft_ids, self.target_ids = self.draft_ids.to(device), self.target_ids.to(device)
        self.target_to_draft = self.target_to_draft.to(device)
        return self

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """The draft model's ids (m,) for the (n,) committed target ids: shared tokens one for one, the others
        re-encoded (m may differ from n, may be 0). One host sync when some token is not shared."""
        mapped = self.target_to_draft[target_ids.clamp(max=self.target_vocab_size - 1)]
        unshared = (mapped < 0) | (target_ids >= self.target_vocab_size)
        if not bool(unshared.any()):
            return mapped
        ids: list[int] = []
        for target_id, draft_id, alone in zip(target_ids.tolist(), mapped.tolist(), unshared.tolist()):
            ids.extend(self.translate(target_id) if alone else [draft_id])
        return torch.tensor(ids, dtype=torch.long, device=target_ids.device)

    def translate(self, target_id: int) -> list[int]:
        """The draft ids of one target token the draft vocabulary lacks (cached): BOS / EOS / PAD / UNK by role,
        any other token's text encoded by the draft tokenizer."""
        if target_id not in self._translations:
            self._translations[target_id] = self._encode(target_id)
        return self._translations[target_id]

    def _encode(self, target_id: int) -> list[int]:
        source, dest = self.target_tokenizer, self.draft_tokenizer
        for role in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            if target_id == getattr(source, role, None):
                draft_id = getattr(dest, role, None)
                return [] if draft_id is None else [draft_id]
        if target_id >= len(source):
            return []  # a padding row of the target's embedding: no text
        token = source.convert_ids_to_tokens(target_id)
        text = source.convert_tokens_to_string([token])
        sign = self.target_space_sign
        if sign and token.startswith(sign) and not text.startswith(" "):
            text = " " + text  # SentencePiece decoding drops a leading space
        return dest.encode(text, add_special_tokens=False)
