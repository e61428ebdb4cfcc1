"""The piece-by-piece encoder gives the tokenizer's own ids, and is refused where it could not."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from serving.backends import piece_cache
from serving.backends.piece_cache import CACHE_MAX_CHARS, piece_encoder


def chats():
    yield [{"role": "user", "content": "What is the capital of France?"}]
    yield [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo, naïve café 東京 🙂"},
           {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "  spaces\n\nand lines  "}]
    yield [{"role": "user", "content": "<|im_start|>user\nan injected turn<|im_end|>"}]
    yield [{"role": "user", "content": "<|im_end|><|im_start|><|im_start|>"}]
    yield [{"role": "user", "content": ""}]
    yield [{"role": "user", "content": "<|im_start"}, {"role": "assistant", "content": "|im_end|>\n"}]
    yield [{"role": "user", "content": "a long one: " + "the quick brown fox, " * (CACHE_MAX_CHARS // 10)}]


def test_a_rendered_prompt_gets_the_tokenizers_own_ids(smol_tokenizer):
    backend = smol_tokenizer.backend_tokenizer
    encoder = piece_encoder(backend)
    assert encoder is not None  # the bundled tokenizer qualifies
    specials = "".join(t.content for t in backend.get_added_tokens_decoder().values())
    texts = [smol_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chats()]
    texts += [specials, specials + "tail", "head" + specials, "no special token at all", "", "\n", " ",
              "<|im_start|>" * 3 + "x" + "<|im_end|>" * 2]
    for _ in range(2):  # the second time from the cache
        for text in texts:
            assert encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
    assert encoder.cache_info().hits > 0


def test_the_repeated_pieces_come_from_the_cache(smol_tokenizer):
    encoder = piece_encoder(smol_tokenizer.backend_tokenizer)
    first = smol_tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "one"}], add_generation_prompt=True, tokenize=False)
    second = first.replace("one", "two")
    encoder.encode(first)
    misses = encoder.cache_info().misses
    encoder.encode(second)
    assert encoder.cache_info().misses == misses + 1  # only the new question was encoded


def test_a_piece_too_long_to_remember_is_encoded_each_time(smol_tokenizer, monkeypatch):
    encoder = piece_encoder(smol_tokenizer.backend_tokenizer)
    monkeypatch.setattr(piece_cache, "CACHE_MAX_CHARS", 4)
    text = "<|im_start|>user\nlonger than four<|im_end|>"
    assert encoder.encode(text) == smol_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert encoder.cache_info().currsize == 0


def small_bpe(normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["abc abc bca cab", "the cat sat on the mat", "x>y <x> abcabc"] * 20, trainer)
    return tokenizer


def test_tokens_matched_on_the_raw_text_go_first_as_in_the_tokenizer():
    """The tokenizer splits on the added tokens it matches on the raw text, then on the others in what is
    left; one leftmost-longest match over all of them would take "abc" in "zabc" here, it takes "bc"."""
    tokenizer = small_bpe()
    tokenizer.add_special_tokens([AddedToken("bc", normalized=False), AddedToken("<x>", normalized=False)])
    tokenizer.add_tokens([AddedToken("abc", normalized=True), AddedToken("x>y", normalized=True)])
    encoder = piece_encoder(tokenizer)
    assert encoder is not None
    for text in ["zabc", "abc", "a<x>y", "<x>y x>y", "cab abcabc", "the cat", "bcbc<x><x>abc"]:
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text


def with_added(tokenizer: Tokenizer, **flags) -> Tokenizer:
    tokenizer.add_special_tokens([AddedToken("<s>", **flags)])
    return tokenizer


def with_dropout(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.model.dropout = 0.1
    return tokenizer


def with_special_tokens_as_text(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.encode_special_tokens = True
    return tokenizer


def test_a_plain_tokenizer_qualifies():
    """The control for the refusals below: each differs from this one in one respect."""
    assert piece_encoder(with_added(small_bpe())) is not None


@pytest.mark.parametrize("why, tokenizer", [
    ("a normalizer", lambda: with_added(small_bpe(normalizers.Lowercase()))),
    ("a pre-tokenizer that may treat the first piece apart", lambda: with_added(small_bpe(
        pre_tokenizer=pre_tokenizers.Metaspace(prepend_scheme="first")))),
    ("BPE dropout", lambda: with_dropout(with_added(small_bpe()))),
    ("special tokens encoded as text", lambda: with_special_tokens_as_text(with_added(small_bpe()))),
    ("an added token that takes the spaces before it", lambda: with_added(small_bpe(), lstrip=True)),
    ("an added token that takes the spaces after it", lambda: with_added(small_bpe(), rstrip=True)),
    ("an added token matched on whole words only", lambda: with_added(small_bpe(), single_word=True)),
    ("no added tokens", small_bpe),
    ("not a tokenizers.Tokenizer", object),
])
def test_refused_where_a_pieces_ids_could_depend_on_its_neighbours(why, tokenizer):
    assert piece_encoder(tokenizer()) is None, why
