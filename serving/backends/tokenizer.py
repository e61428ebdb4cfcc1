"""The pipeline's Tokenizer protocol over a transformers tokenizer (the chat template, then ids)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from serving.backends.piece_cache import piece_encoder


class HFTokenizer:
    """The pipeline's Tokenizer protocol over a transformers tokenizer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        #: A fast tokenizer's Rust side: the rendered template straight to ids, without transformers'
        #: wrapper (apply_chat_template(tokenize=True) is the same two steps, with the wrapper's overhead on top).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        #: Detokenizing, twice a generated token on the event loop, also goes straight to the Rust side (the
        #: wrapper costs more than the decode itself) unless transformers would clean the text up after it.
        self._decode_backend = self._backend if self._backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True) else None
        #: The rendered template piece by piece between its special tokens, the pieces every prompt repeats
        #: (system prompt, role headers) remembered (serving/backends/piece_cache.py), where that gives the same ids.
        self._pieces = piece_encoder(self._backend) if self._backend is not None else None

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if self._backend is None:  # no Rust side: the template's own tokenization
            ids = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return self._encode(self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                                tokenize=False))

    def encode_chat_tools(self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping]) -> list[int] | None:
        """Token ids with *tools* rendered by the model's chat template; None when the template ignores them
        (then stages/tools.py lists the tools in the system message instead)."""
        render = self._tokenizer.apply_chat_template
        plain = render(list(messages), add_generation_prompt=True, tokenize=False)
        text = render(list(messages), tools=list(tools), add_generation_prompt=True, tokenize=False)
        return None if text == plain else self._encode(text)

    def _encode(self, text: str) -> list[int]:
        """A rendered chat template's ids: its special tokens are in the text already."""
        if self._pieces is not None:
            return self._pieces.encode(text)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize(self, *, text: str | None = None, messages: Sequence[Mapping[str, str]] | None = None,
                 add_special_tokens: bool = True, add_generation_prompt: bool = True) -> list[int]:
        """The ids of *text* (with the tokenizer's special tokens unless told not to) or of *messages*
        through the chat template (its special tokens are in the rendered text), as vLLM's ``/tokenize``."""
        if messages is not None:
            rendered = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                           tokenize=False)
            return list(self._tokenizer(rendered, add_special_tokens=add_special_tokens)["input_ids"])
        return list(self._tokenizer(text or "", add_special_tokens=add_special_tokens)["input_ids"])

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it."""
        return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))

    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._decode_backend is not None:
            return self._decode_backend.decode(token_ids, skip_special_tokens=True)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
