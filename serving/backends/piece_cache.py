"""A rendered chat template to token ids, piece by piece, remembering the pieces that repeat.

A Hugging Face tokenizer splits its input at its added tokens (``<|im_start|>``...) before anything
else, and encodes each piece of text between them on its own. A rendered chat prompt is mostly pieces
that every request repeats (the system prompt, each role's header, the generation prompt), so
:class:`PieceEncoder` splits the text the same way and keeps the ids of recent pieces: a request then
encodes only its new text (encoding runs on the event loop).

The ids are the tokenizer's own only where a piece's ids cannot depend on what is around it, so
:func:`piece_encoder` gives one only for tokenizers where that holds: no normalizer (added tokens are
matched on the raw text), a byte-level pre-tokenizer (it treats each piece alike, wherever it is), a
BPE model without dropout, and added tokens that do not take the whitespace or word boundaries around
them (``lstrip``, ``rstrip``, ``single_word``). Anything else keeps encoding the whole text.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

#: Pieces remembered (least recently used go first), and the longest piece remembered, in characters:
#: a long piece's own encoding outweighs the call's fixed cost, and the memory stays small (a few MB).
CACHE_SIZE = 256
CACHE_MAX_CHARS = 1024


class PieceEncoder:
    """``encode(text)`` equals ``backend.encode(text, add_special_tokens=False).ids`` (see the module)."""

    def __init__(self, backend: Any, added: dict[str, tuple[int, bool]]):
        self._backend = backend
        self._ids = {content: token_id for content, (token_id, _) in added.items()}
        # The tokenizer's two passes: the tokens matched on the raw text first, then, in the text between
        # them, those matched on the normalized text (the same text here: there is no normalizer). In each,
        # the leftmost match and, at one position, the longest token (re tries the alternatives in order).
        self._splits = [re.compile("(" + "|".join(re.escape(t) for t in sorted(group, key=len, reverse=True)) + ")")
                        for group in ([t for t, (_, normalized) in added.items() if not normalized],
                                      [t for t, (_, normalized) in added.items() if normalized]) if group]
        self._cached = lru_cache(maxsize=CACHE_SIZE)(self._piece)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        self._encode(text, 0, ids)
        return ids

    def cache_info(self):
        return self._cached.cache_info()

    def _encode(self, text: str, level: int, ids: list[int]) -> None:
        if level == len(self._splits):
            ids += self._piece(text) if len(text) > CACHE_MAX_CHARS else self._cached(text)
            return
        for i, part in enumerate(self._splits[level].split(text)):
            if i % 2:  # re.split puts the separators it captured at the odd places
                ids.append(self._ids[part])
            elif part:
                self._encode(part, level + 1, ids)

    def _piece(self, text: str) -> tuple[int, ...]:
        return tuple(self._backend.encode(text, add_special_tokens=False).ids)


def piece_encoder(backend: Any) -> PieceEncoder | None:
    """A :class:`PieceEncoder` for a ``tokenizers.Tokenizer``, or None where its pieces' ids could depend
    on their neighbours (see the module)."""
    from tokenizers import models, pre_tokenizers

    try:
        added = backend.get_added_tokens_decoder()
        plain = (backend.normalizer is None and not backend.encode_special_tokens
                 and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel)
                 and isinstance(backend.model, models.BPE) and backend.model.dropout is None)
    except AttributeError:  # not a tokenizers.Tokenizer
        return None
    if not plain or not added or any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None
    return PieceEncoder(backend, {token.content: (token_id, token.normalized) for token_id, token in added.items()})
