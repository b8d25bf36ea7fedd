"""Tests pinning the behaviour of ``distill.tokenizer``."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, pre_tokenizers, trainers

from distill.tokenizer import (
    CHAR_SPECIAL_TOKENS,
    DEFAULT_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    SpecialIds,
    Tokenizer,
    TokenizerError,
    tokenizer_from_spec,
)

# Computed once from CharTokenizer() and pinned: a change means every cache / checkpoint keyed by
# the default tokenizer's hash is invalidated, which must be a deliberate decision.
DEFAULT_CHAR_HASH = "b30275fd4a2d5d89cee72db1c83119880abf32cd40f4808fd891c63b53b97543"

WORD_VOCAB = {
    "<pad>": 0,
    "<bos>": 1,
    "<eos>": 2,
    "[UNK]": 3,
    "hello": 4,
    "world": 5,
    "foo": 6,
    "bar": 7,
}

HF_KWARGS: dict[str, Any] = {
    "pad_token": "<pad>",
    "mask_token": "<mask>",
    "bos_token": "<bos>",
    "stop_tokens": ["<eos>"],
    "add_mask_token": True,
}


def _field_error(field: str) -> str:
    """Regex matching the start of a TokenizerError message about ``field``."""
    return rf"^`{field}` must .*; received "


def _word_level_tokenizer(vocab: dict[str, int] | None = None) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel(dict(vocab or WORD_VOCAB), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture
def word_level_path(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tokenizer.json"
    _word_level_tokenizer().save(str(path))
    return path


@pytest.fixture
def bpe_path(tmp_path: pathlib.Path) -> pathlib.Path:
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=60,
        special_tokens=["<unk>", "<pad>", "<bos>", "<eos>", "<mask>"],
        show_progress=False,
    )
    corpus = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 5
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _reverse_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {key: _reverse_keys(obj[key]) for key in reversed(list(obj))}
    if isinstance(obj, list):
        return [_reverse_keys(item) for item in obj]
    return obj


# --------------------------------------------------------------------------------------------
# SpecialIds
# --------------------------------------------------------------------------------------------


def test_special_ids_converts_stop_id_list_to_tuple() -> None:
    special = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=[3, 4])  # type: ignore[arg-type]
    assert special.stop_ids == (3, 4)
    assert isinstance(special.stop_ids, tuple)
    special.validate(5)


def test_special_ids_accepts_numpy_ints_and_stores_python_ints() -> None:
    special = SpecialIds(pad_id=np.int64(0), mask_id=np.int32(1), bos_id=2, stop_ids=(np.int64(3),))
    assert type(special.pad_id) is int
    assert type(special.mask_id) is int
    assert type(special.stop_ids[0]) is int


def test_special_ids_is_frozen_and_hashable() -> None:
    special = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3,))
    with pytest.raises(AttributeError):
        special.pad_id = 5  # type: ignore[misc]
    same = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=[3])  # type: ignore[arg-type]
    assert same == special
    assert hash(same) == hash(special)


@pytest.mark.parametrize("field", ["pad_id", "mask_id", "bos_id"])
@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_special_ids_rejects_non_int_scalar_ids(field: str, bad: object) -> None:
    kwargs: dict[str, Any] = {"pad_id": 0, "mask_id": 1, "bos_id": 2, "stop_ids": (3,)}
    kwargs[field] = bad
    with pytest.raises(TokenizerError, match=_field_error(field)):
        SpecialIds(**kwargs)


@pytest.mark.parametrize("bad", [3, "3", (3, 1.5), [True]])
def test_special_ids_rejects_non_int_stop_ids(bad: object) -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_ids")):
        SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["pad_id", "mask_id", "bos_id"])
@pytest.mark.parametrize("bad", [-1, 10, 11])
def test_special_ids_validate_rejects_out_of_range_scalar_ids(field: str, bad: int) -> None:
    kwargs: dict[str, Any] = {"pad_id": 0, "mask_id": 1, "bos_id": 2, "stop_ids": (3,)}
    kwargs[field] = bad
    with pytest.raises(TokenizerError, match=_field_error(field)) as info:
        SpecialIds(**kwargs).validate(10)
    assert "[0, 10)" in str(info.value)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("stop_ids", [(10,), (3, -1)])
def test_special_ids_validate_rejects_out_of_range_stop_ids(stop_ids: tuple[int, ...]) -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_ids")):
        SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=stop_ids).validate(10)


def test_special_ids_validate_rejects_empty_stop_ids() -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_ids") + r"\(\)$"):
        SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=()).validate(10)


def test_special_ids_validate_rejects_duplicate_stop_ids() -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_ids") + r"\(3, 3\)$"):
        SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3, 3)).validate(10)


def test_special_ids_validate_rejects_mask_id_in_stop_ids_with_exact_message() -> None:
    special = SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(1, 3))
    with pytest.raises(TokenizerError) as info:
        special.validate(10)
    assert str(info.value) == "`stop_ids` must not contain the mask id 1; received (1, 3)"


@pytest.mark.parametrize("other", ["pad_id", "bos_id"])
def test_special_ids_validate_rejects_mask_id_equal_to_pad_or_bos(other: str) -> None:
    kwargs: dict[str, Any] = {"pad_id": 0, "mask_id": 1, "bos_id": 2, "stop_ids": (3,)}
    kwargs[other] = 1
    with pytest.raises(TokenizerError, match=_field_error("mask_id")) as info:
        SpecialIds(**kwargs).validate(10)
    assert f"`{other}`" in str(info.value)


def test_special_ids_validate_allows_pad_equal_to_bos_and_to_a_stop_id() -> None:
    SpecialIds(pad_id=0, mask_id=1, bos_id=0, stop_ids=(0,)).validate(2)


@pytest.mark.parametrize("vocab_size", [0, -3, 2.0, True])
def test_special_ids_validate_rejects_bad_vocab_size(vocab_size: Any) -> None:
    with pytest.raises(TokenizerError, match=_field_error("vocab_size")):
        SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3,)).validate(vocab_size)


@given(
    st.integers(min_value=3, max_value=1000).flatmap(
        lambda v: st.tuples(
            st.just(v),
            st.lists(st.integers(0, v - 1), min_size=3, max_size=3, unique=True),
            st.sets(st.integers(0, v - 1), min_size=1, max_size=5),
        )
    )
)
def test_special_ids_validate_accepts_any_ids_satisfying_the_rules(
    case: tuple[int, list[int], set[int]],
) -> None:
    vocab_size, (pad_id, mask_id, bos_id), stops = case
    stop_ids = tuple(sorted(stops - {mask_id})) or (pad_id,)
    SpecialIds(pad_id=pad_id, mask_id=mask_id, bos_id=bos_id, stop_ids=stop_ids).validate(
        vocab_size
    )


def test_tokenizer_error_is_a_value_error() -> None:
    assert issubclass(TokenizerError, ValueError)


# --------------------------------------------------------------------------------------------
# CharTokenizer
# --------------------------------------------------------------------------------------------


def test_default_alphabet_contents() -> None:
    assert DEFAULT_ALPHABET == "0123456789abcdefghijklmnopqrstuvwxyz +=|:,;?->\n"
    assert len(set(DEFAULT_ALPHABET)) == len(DEFAULT_ALPHABET)


def test_char_special_ids_are_fixed() -> None:
    tok = CharTokenizer()
    assert CHAR_SPECIAL_TOKENS == ("<pad>", "<mask>", "<bos>", "<eos>")
    assert tok.special == SpecialIds(pad_id=0, mask_id=1, bos_id=2, stop_ids=(3,))
    assert [tok.token_to_id(t) for t in CHAR_SPECIAL_TOKENS] == [0, 1, 2, 3]


def test_char_alphabet_ids_follow_specials_in_order() -> None:
    tok = CharTokenizer("xyz")
    assert tok.vocab_size == 7
    assert tok.encode("zyx") == [6, 5, 4]
    assert tok.token_to_id("x") == 4
    assert CharTokenizer().vocab_size == 4 + len(DEFAULT_ALPHABET)


def test_char_tokenizer_satisfies_protocol() -> None:
    assert isinstance(CharTokenizer(), Tokenizer)


@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=200))
def test_char_round_trip_for_random_strings_over_the_alphabet(text: str) -> None:
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == text


@given(st.lists(st.integers(0, 4 + len(DEFAULT_ALPHABET) - 1), max_size=100))
def test_char_decode_skip_special_drops_exactly_the_special_ids(ids: list[int]) -> None:
    tok = CharTokenizer()
    expected = "".join(DEFAULT_ALPHABET[i - 4] for i in ids if i >= 4)
    assert tok.decode(ids) == expected
    rendered = tok.decode(ids, skip_special=False)
    assert rendered == "".join(
        CHAR_SPECIAL_TOKENS[i] if i < 4 else DEFAULT_ALPHABET[i - 4] for i in ids
    )


def test_char_decode_renders_special_names_when_not_skipping() -> None:
    tok = CharTokenizer("ab")
    ids = [2, 4, 1, 5, 3, 0]
    assert tok.decode(ids, skip_special=False) == "<bos>a<mask>b<eos><pad>"
    assert tok.decode(ids) == "ab"


def test_char_alphabet_stop_char_is_skipped_by_decode() -> None:
    tok = CharTokenizer("ab\n", stop_tokens=["\n", "<eos>"])
    assert tok.special.stop_ids == (6, 3)
    assert tok.decode(tok.encode("a\nb")) == "ab"
    assert tok.decode(tok.encode("a\nb"), skip_special=False) == "a\nb"


def test_char_decode_accepts_numpy_arrays() -> None:
    tok = CharTokenizer()
    ids = np.asarray(tok.encode("1+2=3"), dtype=np.int32)
    assert tok.decode(ids) == "1+2=3"


def test_char_encode_does_not_add_specials_and_empty_text_is_empty() -> None:
    tok = CharTokenizer()
    assert tok.encode("") == []
    assert tok.decode([]) == ""


def test_char_unknown_char_error_names_text_char_and_index() -> None:
    tok = CharTokenizer()
    with pytest.raises(TokenizerError, match=_field_error("text")) as info:
        tok.encode("ab*c")
    message = str(info.value)
    assert "'*'" in message
    assert "index 2" in message


def test_char_encode_does_not_parse_special_token_strings() -> None:
    with pytest.raises(TokenizerError, match=_field_error("text")):
        CharTokenizer().encode("<eos>")


def test_char_encode_rejects_non_str() -> None:
    with pytest.raises(TokenizerError, match=_field_error("text")):
        CharTokenizer().encode(b"abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_ids", [[4, 51], [-1], [4, 1.0], "abc", 5, np.zeros((2, 2), int)])
def test_char_decode_rejects_bad_ids_naming_ids(bad_ids: Any) -> None:
    with pytest.raises(TokenizerError, match=_field_error("ids")):
        CharTokenizer().decode(bad_ids)


def test_char_decode_out_of_range_error_reports_value_and_index() -> None:
    with pytest.raises(TokenizerError) as info:
        CharTokenizer().decode([4, 5, 99])
    assert str(info.value) == "`ids` must contain only ids in [0, 51); received 99 at index 2"


def test_char_token_to_id_unknown_token_names_token() -> None:
    with pytest.raises(TokenizerError, match=_field_error("token")):
        CharTokenizer().token_to_id("<unk>")


def test_char_rejects_empty_alphabet() -> None:
    with pytest.raises(TokenizerError, match=_field_error("alphabet")):
        CharTokenizer("")


def test_char_rejects_non_str_alphabet() -> None:
    with pytest.raises(TokenizerError, match=_field_error("alphabet")):
        CharTokenizer(["a", "b"])  # type: ignore[arg-type]


def test_char_duplicate_alphabet_char_error_names_alphabet_and_the_char() -> None:
    with pytest.raises(TokenizerError, match=_field_error("alphabet")) as info:
        CharTokenizer("abcb")
    assert "'b'" in str(info.value)
    assert "1 and 3" in str(info.value)


@pytest.mark.parametrize(
    "stop_tokens",
    [
        ["<unk>"],  # not a token
        ["z"],  # not in the alphabet
        [],  # empty
        "<eos>",  # bare string, not a sequence of tokens
        ["<eos>", "<eos>"],  # duplicate
        ["<mask>"],  # the mask token can never stop generation
        [3],  # not a string
    ],
)
def test_char_invalid_stop_tokens_error_names_stop_tokens(stop_tokens: Any) -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_tokens")):
        CharTokenizer("abc", stop_tokens=stop_tokens)


def test_char_content_hash_is_pinned_for_default_tokenizer() -> None:
    assert CharTokenizer().content_hash() == DEFAULT_CHAR_HASH


def test_char_content_hash_is_stable_across_instances_and_processes() -> None:
    assert CharTokenizer().content_hash() == CharTokenizer().content_hash()
    code = "from distill.tokenizer import CharTokenizer; print(CharTokenizer().content_hash())"
    for seed in ("0", "12345"):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=pathlib.Path(__file__).resolve().parents[1],
        )
        assert result.stdout.strip() == DEFAULT_CHAR_HASH


def test_char_content_hash_is_hex_sha256() -> None:
    digest = CharTokenizer("ab").content_hash()
    assert len(digest) == 64
    int(digest, 16)


def test_char_content_hash_changes_with_alphabet_and_stop_tokens() -> None:
    base = CharTokenizer("abc")
    hashes = {
        base.content_hash(),
        CharTokenizer("abd").content_hash(),
        CharTokenizer("acb").content_hash(),
        CharTokenizer("abc", stop_tokens=["c"]).content_hash(),
        CharTokenizer("abc", stop_tokens=["<eos>", "c"]).content_hash(),
        CharTokenizer("abc", stop_tokens=["c", "<eos>"]).content_hash(),
    }
    assert len(hashes) == 6
    assert CharTokenizer("abc", stop_tokens=("<eos>",)).content_hash() == base.content_hash()


# --------------------------------------------------------------------------------------------
# HFTokenizer
# --------------------------------------------------------------------------------------------


def test_hf_word_level_special_ids_resolved(word_level_path: pathlib.Path) -> None:
    kwargs = {**HF_KWARGS, "mask_token": "[UNK]", "add_mask_token": False}
    tok = HFTokenizer.from_file(word_level_path, **kwargs)
    assert tok.vocab_size == len(WORD_VOCAB)
    assert tok.special == SpecialIds(pad_id=0, mask_id=3, bos_id=1, stop_ids=(2,))
    assert isinstance(tok, Tokenizer)


def test_hf_word_level_encode_decode(word_level_path: pathlib.Path) -> None:
    tok = HFTokenizer.from_file(word_level_path, **HF_KWARGS)
    assert tok.encode("hello world foo") == [4, 5, 6]
    assert tok.encode("") == []
    ids = [1, 4, 5, 8, 2, 0]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special=False) == "<bos> hello world <mask> <eos> <pad>"
    assert tok.decode(np.asarray([6, 7])) == "foo bar"


def test_hf_encode_never_adds_special_tokens(word_level_path: pathlib.Path) -> None:
    from tokenizers import processors

    raw = _word_level_tokenizer()
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 2)]
    )
    assert raw.encode("hello").ids == [1, 4, 2]
    tok = HFTokenizer(raw, **HF_KWARGS)
    assert tok.encode("hello") == [4]


def test_hf_add_mask_token_appends_without_moving_existing_ids(
    word_level_path: pathlib.Path,
) -> None:
    tok = HFTokenizer.from_file(word_level_path, **HF_KWARGS)
    assert tok.vocab_size == len(WORD_VOCAB) + 1
    assert tok.special.mask_id == len(WORD_VOCAB)
    assert tok.token_to_id("<mask>") == len(WORD_VOCAB)
    for token, token_id in WORD_VOCAB.items():
        assert tok.token_to_id(token) == token_id
    assert tok.encode("hello <mask> world") == [4, 8, 5]


def test_hf_add_mask_token_reuses_an_existing_mask_token(bpe_path: pathlib.Path) -> None:
    raw = tokenizers.Tokenizer.from_file(str(bpe_path))
    tok = HFTokenizer.from_file(bpe_path, **HF_KWARGS)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.special.mask_id == raw.token_to_id("<mask>")


def test_hf_constructor_does_not_mutate_the_callers_tokenizer() -> None:
    raw = _word_level_tokenizer()
    tok = HFTokenizer(raw, **HF_KWARGS)
    assert tok.vocab_size == len(WORD_VOCAB) + 1
    assert raw.get_vocab_size(with_added_tokens=True) == len(WORD_VOCAB)
    assert raw.token_to_id("<mask>") is None


def test_hf_bpe_round_trip_and_special_ids(bpe_path: pathlib.Path) -> None:
    tok = HFTokenizer.from_file(bpe_path, **HF_KWARGS)
    raw = tokenizers.Tokenizer.from_file(str(bpe_path))
    assert tok.special == SpecialIds(
        pad_id=raw.token_to_id("<pad>"),
        mask_id=raw.token_to_id("<mask>"),
        bos_id=raw.token_to_id("<bos>"),
        stop_ids=(raw.token_to_id("<eos>"),),
    )
    ids = tok.encode("the cat sat")
    assert ids == raw.encode("the cat sat", add_special_tokens=False).ids
    assert all(0 <= i < tok.vocab_size for i in ids)
    with_specials = [tok.special.bos_id, *ids, tok.special.stop_ids[0], tok.special.pad_id]
    assert tok.decode(with_specials) == tok.decode(ids)
    assert "<eos>" in tok.decode(with_specials, skip_special=False)


def test_hf_skip_special_drops_pad_bos_stop_even_if_not_marked_special(
    word_level_path: pathlib.Path,
) -> None:
    # In the WordLevel fixture "<pad>", "<bos>", "<eos>" are ordinary vocabulary entries.
    tok = HFTokenizer.from_file(word_level_path, **{**HF_KWARGS, "stop_tokens": ["<eos>", "bar"]})
    assert tok.decode([1, 4, 7, 2, 0]) == "hello"


@pytest.mark.parametrize("argument", ["pad_token", "bos_token", "mask_token"])
def test_hf_missing_token_error_names_the_argument(
    word_level_path: pathlib.Path, argument: str
) -> None:
    kwargs = {**HF_KWARGS, "add_mask_token": False, argument: "<missing>"}
    with pytest.raises(TokenizerError, match=_field_error(argument)) as info:
        HFTokenizer.from_file(word_level_path, **kwargs)
    assert "'<missing>'" in str(info.value)


def test_hf_missing_stop_token_error_names_stop_tokens(word_level_path: pathlib.Path) -> None:
    kwargs = {**HF_KWARGS, "stop_tokens": ["<eos>", "<eot>"]}
    with pytest.raises(TokenizerError, match=_field_error("stop_tokens")) as info:
        HFTokenizer.from_file(word_level_path, **kwargs)
    assert "'<eot>'" in str(info.value)


@pytest.mark.parametrize("stop_tokens", [[], "<eos>", ["<eos>", "<eos>"]])
def test_hf_invalid_stop_tokens_error_names_stop_tokens(
    word_level_path: pathlib.Path, stop_tokens: Any
) -> None:
    with pytest.raises(TokenizerError, match=_field_error("stop_tokens")):
        HFTokenizer.from_file(word_level_path, **{**HF_KWARGS, "stop_tokens": stop_tokens})


def test_hf_mask_token_as_stop_token_is_rejected(word_level_path: pathlib.Path) -> None:
    kwargs = {**HF_KWARGS, "mask_token": "foo", "add_mask_token": False, "stop_tokens": ["foo"]}
    with pytest.raises(TokenizerError, match=_field_error("stop_ids")):
        HFTokenizer.from_file(word_level_path, **kwargs)


def test_hf_add_mask_token_must_be_bool(word_level_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerError, match=_field_error("add_mask_token")):
        HFTokenizer.from_file(word_level_path, **{**HF_KWARGS, "add_mask_token": "yes"})


def test_hf_missing_file_error_names_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerError, match=_field_error("path")) as info:
        HFTokenizer.from_file(missing, **HF_KWARGS)
    assert str(missing) in str(info.value)


def test_hf_directory_path_error_names_path(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerError, match=_field_error("path")):
        HFTokenizer.from_file(tmp_path, **HF_KWARGS)


def test_hf_corrupt_file_error_names_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=_field_error("path")):
        HFTokenizer.from_file(path, **HF_KWARGS)


def test_hf_from_str_invalid_json_names_json_str() -> None:
    with pytest.raises(TokenizerError, match=_field_error("json_str")):
        HFTokenizer.from_str("{not json", **HF_KWARGS)


def test_hf_from_str_matches_from_file(word_level_path: pathlib.Path) -> None:
    from_file = HFTokenizer.from_file(str(word_level_path), **HF_KWARGS)
    from_str = HFTokenizer.from_str(word_level_path.read_text(encoding="utf-8"), **HF_KWARGS)
    assert from_file.special == from_str.special
    assert from_file.vocab_size == from_str.vocab_size
    assert from_file.content_hash() == from_str.content_hash()


def test_hf_decode_out_of_range_names_ids(word_level_path: pathlib.Path) -> None:
    tok = HFTokenizer.from_file(word_level_path, **HF_KWARGS)
    with pytest.raises(TokenizerError, match=_field_error("ids")):
        tok.decode([4, tok.vocab_size])


def test_hf_token_to_id_unknown_names_token(word_level_path: pathlib.Path) -> None:
    tok = HFTokenizer.from_file(word_level_path, **HF_KWARGS)
    with pytest.raises(TokenizerError, match=_field_error("token")):
        tok.token_to_id("nope")


def test_hf_rejects_vocab_with_holes() -> None:
    holes = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "[UNK]": 3, "<mask>": 9}
    with pytest.raises(TokenizerError, match=_field_error("tokenizer")):
        HFTokenizer(_word_level_tokenizer(holes), **HF_KWARGS)


def test_hf_content_hash_independent_of_json_key_order(word_level_path: pathlib.Path) -> None:
    text = word_level_path.read_text(encoding="utf-8")
    reordered = json.dumps(_reverse_keys(json.loads(text)), indent=3)
    assert reordered != text
    a = HFTokenizer.from_str(text, **HF_KWARGS)
    b = HFTokenizer.from_str(reordered, **HF_KWARGS)
    assert a.content_hash() == b.content_hash()
    assert a.content_hash() == HFTokenizer.from_file(word_level_path, **HF_KWARGS).content_hash()


def test_hf_content_hash_changes_with_vocab_and_special_ids(word_level_path: pathlib.Path) -> None:
    base = HFTokenizer.from_file(word_level_path, **HF_KWARGS)
    other_stop = HFTokenizer.from_file(word_level_path, **{**HF_KWARGS, "stop_tokens": ["bar"]})
    other_vocab = HFTokenizer(_word_level_tokenizer({**WORD_VOCAB, "baz": 8}), **HF_KWARGS)
    hashes = {base.content_hash(), other_stop.content_hash(), other_vocab.content_hash()}
    assert len(hashes) == 3
    assert base.content_hash() != CharTokenizer().content_hash()


# --------------------------------------------------------------------------------------------
# tokenizer_from_spec
# --------------------------------------------------------------------------------------------


def test_spec_char_defaults_match_constructor() -> None:
    tok = tokenizer_from_spec({"kind": "char"})
    assert isinstance(tok, CharTokenizer)
    assert tok.content_hash() == DEFAULT_CHAR_HASH


def test_spec_char_with_options() -> None:
    tok = tokenizer_from_spec({"kind": "char", "alphabet": "abc", "stop_tokens": ["c"]})
    assert tok.content_hash() == CharTokenizer("abc", stop_tokens=["c"]).content_hash()


def test_spec_hf_builds_from_file(word_level_path: pathlib.Path) -> None:
    spec = {"kind": "hf", "path": str(word_level_path), **HF_KWARGS}
    tok = tokenizer_from_spec(spec)
    assert isinstance(tok, HFTokenizer)
    assert tok.content_hash() == HFTokenizer.from_file(word_level_path, **HF_KWARGS).content_hash()


def test_spec_hf_add_mask_token_is_optional(word_level_path: pathlib.Path) -> None:
    spec = {"kind": "hf", "path": str(word_level_path), **HF_KWARGS, "mask_token": "[UNK]"}
    del spec["add_mask_token"]
    assert tokenizer_from_spec(spec).special.mask_id == 3


def test_spec_unknown_kind_exact_message() -> None:
    with pytest.raises(TokenizerError) as info:
        tokenizer_from_spec({"kind": "bpe"})
    assert str(info.value) == "`tokenizer.kind` must be one of 'char', 'hf'; received 'bpe'"


def test_spec_missing_kind_names_kind() -> None:
    with pytest.raises(TokenizerError, match=_field_error(r"tokenizer\.kind")):
        tokenizer_from_spec({"alphabet": "abc"})


def test_spec_non_mapping_names_tokenizer() -> None:
    with pytest.raises(TokenizerError, match=_field_error("tokenizer")):
        tokenizer_from_spec(["char"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ({"kind": "char", "vocab": "abc"}, "vocab"),
        ({"kind": "char", "pad_token": "<pad>"}, "pad_token"),
        ({"kind": "hf", "path": "x", "alphabet": "abc"}, "alphabet"),
    ],
)
def test_spec_unknown_key_names_the_key(spec: dict[str, Any], key: str) -> None:
    with pytest.raises(TokenizerError, match=_field_error(rf"tokenizer\.{key}")):
        tokenizer_from_spec(spec)


@pytest.mark.parametrize("missing", ["path", "pad_token", "mask_token", "bos_token", "stop_tokens"])
def test_spec_hf_missing_required_key_names_the_key(
    word_level_path: pathlib.Path, missing: str
) -> None:
    spec = {"kind": "hf", "path": str(word_level_path), **HF_KWARGS}
    del spec[missing]
    with pytest.raises(TokenizerError, match=_field_error(rf"tokenizer\.{missing}")):
        tokenizer_from_spec(spec)


def test_spec_constructor_errors_are_prefixed_with_tokenizer(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TokenizerError, match=_field_error(r"tokenizer\.alphabet")):
        tokenizer_from_spec({"kind": "char", "alphabet": "aa"})
    with pytest.raises(TokenizerError, match=_field_error(r"tokenizer\.stop_tokens")):
        tokenizer_from_spec({"kind": "char", "stop_tokens": ["<nope>"]})
    spec = {"kind": "hf", "path": str(tmp_path / "missing.json"), **HF_KWARGS}
    with pytest.raises(TokenizerError, match=_field_error(r"tokenizer\.path")):
        tokenizer_from_spec(spec)


@settings(max_examples=50)
@given(st.text(min_size=1, max_size=10).filter(lambda s: s not in ("char", "hf")))
def test_spec_any_other_kind_is_rejected(kind: str) -> None:
    with pytest.raises(TokenizerError, match=_field_error(r"tokenizer\.kind")):
        tokenizer_from_spec({"kind": kind})
