"""Tokenizers used by the distillation pipeline.

Two implementations share the :class:`Tokenizer` protocol:

* :class:`CharTokenizer` -- a built-in character-level tokenizer for synthetic tasks. Its
  vocabulary is the four special tokens ``<pad>``, ``<mask>``, ``<bos>``, ``<eos>`` (ids 0-3, in
  that order) followed by the characters of an alphabet.
* :class:`HFTokenizer` -- a thin wrapper around a Hugging Face ``tokenizers.Tokenizer`` loaded
  from a ``tokenizer.json`` (no ``transformers`` dependency).

Contracts shared by every tokenizer:

* ``encode`` never adds special tokens; callers add ``bos``/``stop`` ids explicitly.
* ``decode`` rejects ids outside ``[0, vocab_size)``; with ``skip_special=True`` it drops the
  pad, mask, bos and stop ids.
* ``content_hash`` is a hex SHA-256 of a canonical JSON description of the vocabulary plus the
  special ids; it is stable across processes and Python versions, so it can key caches and be
  recorded in checkpoints to detect a tokenizer mismatch.
* Every invalid input raises :class:`TokenizerError` (a ``ValueError``) whose message has the
  form "`field` must ...; received ...".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

__all__ = [
    "CHAR_SPECIAL_TOKENS",
    "DEFAULT_ALPHABET",
    "CharTokenizer",
    "HFTokenizer",
    "SpecialIds",
    "Tokenizer",
    "TokenizerError",
    "tokenizer_from_spec",
]

#: Default alphabet of :class:`CharTokenizer`: digits, lowercase letters, punctuation, newline.
DEFAULT_ALPHABET: str = "0123456789abcdefghijklmnopqrstuvwxyz +=|:,;?->\n"

#: Special tokens of :class:`CharTokenizer`; their ids are their positions (0, 1, 2, 3).
CHAR_SPECIAL_TOKENS: tuple[str, str, str, str] = ("<pad>", "<mask>", "<bos>", "<eos>")

_CHAR_HASH_FORMAT = "distill.CharTokenizer/v1"
_HF_HASH_FORMAT = "distill.HFTokenizer/v1"


class TokenizerError(ValueError):
    """Invalid tokenizer configuration or input. Messages read "`field` must ...; received ..."."""


def _error(field: str, must: str, received: str) -> TokenizerError:
    return TokenizerError(f"`{field}` must {must}; received {received}")


def _is_int(value: object) -> bool:
    """True for Python and NumPy integers, False for ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _canonical_json(obj: Any) -> str:
    """Key-order-independent, whitespace-free, ASCII-only JSON encoding."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Return ``ids`` as a list of ``int``; raise naming `ids` if any is not in range."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise _error("ids", "be a sequence of ints", repr(ids))
    if hasattr(ids, "tolist"):  # NumPy / JAX arrays: one conversion instead of per-element
        ids = ids.tolist()
        if not isinstance(ids, list):
            raise _error("ids", "be a 1-D sequence of ints", repr(ids))
    out: list[int] = []
    for index, value in enumerate(ids):
        if not _is_int(value):
            raise _error("ids", "contain only ints", f"{value!r} at index {index}")
        as_int = int(value)
        if not 0 <= as_int < vocab_size:
            raise _error(
                "ids", f"contain only ids in [0, {vocab_size})", f"{as_int} at index {index}"
            )
        out.append(as_int)
    return out


def _check_stop_tokens(stop_tokens: Sequence[str]) -> tuple[str, ...]:
    """Type-check ``stop_tokens``: a non-empty sequence (not a bare str) of unique strings."""
    if isinstance(stop_tokens, str | bytes) or not isinstance(stop_tokens, Sequence):
        raise _error(
            "stop_tokens", "be a sequence of token strings (not a single str)", repr(stop_tokens)
        )
    result = tuple(stop_tokens)
    if not result:
        raise _error("stop_tokens", "be non-empty", repr(result))
    for token in result:
        if not isinstance(token, str):
            raise _error("stop_tokens", "contain only strings", repr(result))
    duplicates = sorted({token for token in result if result.count(token) > 1})
    if duplicates:
        raise _error("stop_tokens", f"not contain duplicates ({duplicates!r})", repr(result))
    return result


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens the pipeline relies on.

    ``stop_ids`` ends a generation (any of them); ``mask_id`` is the diffusion mask and must be
    distinct from every other special id except that ``pad_id`` and ``bos_id`` may coincide with
    each other or with a stop id. Construction only checks types (a list ``stop_ids`` becomes a
    tuple); :meth:`validate` checks the ids against a vocabulary size.
    """

    pad_id: int
    mask_id: int
    bos_id: int
    stop_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("pad_id", "mask_id", "bos_id"):
            value = getattr(self, name)
            if not _is_int(value):
                raise _error(name, "be an int", repr(value))
            object.__setattr__(self, name, int(value))
        stop_ids = self.stop_ids
        if isinstance(stop_ids, str | bytes) or not isinstance(stop_ids, Sequence):
            raise _error("stop_ids", "be a tuple or list of ints", repr(stop_ids))
        for value in stop_ids:
            if not _is_int(value):
                raise _error("stop_ids", "contain only ints", repr(tuple(stop_ids)))
        object.__setattr__(self, "stop_ids", tuple(int(value) for value in stop_ids))

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`TokenizerError` unless these ids are usable with ``vocab_size`` tokens.

        Rules: every id lies in ``[0, vocab_size)``; ``stop_ids`` is non-empty, has no
        duplicates and does not contain ``mask_id``; ``mask_id`` differs from ``pad_id`` and
        ``bos_id``.
        """
        if not _is_int(vocab_size) or vocab_size < 1:
            raise _error("vocab_size", "be a positive int", repr(vocab_size))
        for name in ("pad_id", "mask_id", "bos_id"):
            value = getattr(self, name)
            if not 0 <= value < vocab_size:
                raise _error(name, f"be in [0, {vocab_size})", repr(value))
        if not self.stop_ids:
            raise _error("stop_ids", "be non-empty", repr(self.stop_ids))
        for value in self.stop_ids:
            if not 0 <= value < vocab_size:
                raise _error(
                    "stop_ids", f"contain only ids in [0, {vocab_size})", repr(self.stop_ids)
                )
        if len(set(self.stop_ids)) != len(self.stop_ids):
            raise _error("stop_ids", "not contain duplicates", repr(self.stop_ids))
        if self.mask_id in self.stop_ids:
            raise _error("stop_ids", f"not contain the mask id {self.mask_id}", repr(self.stop_ids))
        if self.mask_id == self.pad_id:
            raise _error("mask_id", f"differ from `pad_id` ({self.pad_id})", repr(self.mask_id))
        if self.mask_id == self.bos_id:
            raise _error("mask_id", f"differ from `bos_id` ({self.bos_id})", repr(self.mask_id))

    def special_set(self) -> frozenset[int]:
        """The ids dropped by ``decode(..., skip_special=True)``: pad, mask, bos and stops."""
        return frozenset((self.pad_id, self.mask_id, self.bos_id, *self.stop_ids))

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description (used in content hashes)."""
        return {
            "pad_id": self.pad_id,
            "mask_id": self.mask_id,
            "bos_id": self.bos_id,
            "stop_ids": list(self.stop_ids),
        }


@typing.runtime_checkable
class Tokenizer(typing.Protocol):
    """What the pipeline needs from a tokenizer.

    * ``vocab_size``: number of ids; every id produced or accepted lies in ``[0, vocab_size)``.
    * ``special``: the special ids, already validated against ``vocab_size``.
    * ``encode(text)``: ids of ``text`` with no special tokens added.
    * ``decode(ids, skip_special=True)``: text of ``ids``; out-of-range ids raise
      :class:`TokenizerError` naming `ids`; with ``skip_special`` the pad, mask, bos and stop ids
      are dropped.
    * ``content_hash()``: hex SHA-256 of a canonical description of the tokenizer and its
      special ids, stable across processes and Python versions.
    * ``token_to_id(token)``: id of a token string; unknown tokens raise naming `token`.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def special(self) -> SpecialIds: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str: ...

    def content_hash(self) -> str: ...

    def token_to_id(self, token: str) -> int: ...


class CharTokenizer:
    """Character-level tokenizer for synthetic tasks.

    Ids: ``<pad>``=0, ``<mask>``=1, ``<bos>``=2, ``<eos>``=3, then the characters of
    ``alphabet`` in order (ids 4, 5, ...). ``stop_tokens`` names the tokens that end a
    generation; each must be a special token other than ``<mask>`` or a character of the
    alphabet. ``encode`` maps each character of the text to its id (special token strings in the
    text are not recognised); ``decode`` renders special tokens by their names when
    ``skip_special=False``.
    """

    #: What :class:`~distill.teacher_contract.TeacherInfo` reports as ``tokenizer_kind``.
    kind: typing.ClassVar[str] = "char"

    def __init__(
        self, alphabet: str = DEFAULT_ALPHABET, *, stop_tokens: Sequence[str] = ("<eos>",)
    ) -> None:
        if not isinstance(alphabet, str):
            raise _error("alphabet", "be a str", repr(alphabet))
        if not alphabet:
            raise _error("alphabet", "be non-empty", repr(alphabet))
        first_index: dict[str, int] = {}
        for index, char in enumerate(alphabet):
            if char in first_index:
                raise _error(
                    "alphabet",
                    "not contain duplicate characters",
                    f"{char!r} at indices {first_index[char]} and {index}",
                )
            first_index[char] = index
        stops = _check_stop_tokens(stop_tokens)

        self._alphabet = alphabet
        self._stop_tokens = stops
        self._id_to_token: tuple[str, ...] = CHAR_SPECIAL_TOKENS + tuple(alphabet)
        self._token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(self._id_to_token)}
        self._char_to_id: dict[str, int] = {
            char: len(CHAR_SPECIAL_TOKENS) + i for i, char in enumerate(alphabet)
        }

        for token in stops:
            if token not in self._token_to_id:
                raise _error(
                    "stop_tokens",
                    "contain only special tokens or alphabet characters",
                    f"unknown token {token!r} in {stops!r}",
                )
            if token == "<mask>":
                raise _error("stop_tokens", "not contain the mask token '<mask>'", repr(stops))

        self._special = SpecialIds(
            pad_id=self._token_to_id["<pad>"],
            mask_id=self._token_to_id["<mask>"],
            bos_id=self._token_to_id["<bos>"],
            stop_ids=tuple(self._token_to_id[token] for token in stops),
        )
        self._special.validate(len(self._id_to_token))
        self._skip_ids = self._special.special_set() | frozenset(range(len(CHAR_SPECIAL_TOKENS)))

    @property
    def vocab_size(self) -> int:
        """``4 + len(alphabet)``."""
        return len(self._id_to_token)

    @property
    def special(self) -> SpecialIds:
        return self._special

    @property
    def alphabet(self) -> str:
        return self._alphabet

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        return self._stop_tokens

    def encode(self, text: str) -> list[int]:
        """One id per character; raises naming `text` on a character outside the alphabet."""
        if not isinstance(text, str):
            raise _error("text", "be a str", repr(text))
        ids: list[int] = []
        char_to_id = self._char_to_id
        for index, char in enumerate(text):
            token_id = char_to_id.get(char)
            if token_id is None:
                raise _error(
                    "text",
                    "contain only characters of the alphabet",
                    f"unknown character {char!r} at index {index}",
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Inverse of :meth:`encode`.

        With ``skip_special=True`` the four special tokens and any stop token (including stop
        characters of the alphabet) are dropped; otherwise special tokens are rendered by name.
        """
        checked = _check_ids(ids, self.vocab_size)
        if skip_special:
            skip = self._skip_ids
            return "".join(self._id_to_token[i] for i in checked if i not in skip)
        return "".join(self._id_to_token[i] for i in checked)

    def token_to_id(self, token: str) -> int:
        """Id of a special token name (e.g. ``"<eos>"``) or of an alphabet character."""
        token_id = self._token_to_id.get(token) if isinstance(token, str) else None
        if token_id is None:
            raise _error("token", "be a token in the vocabulary", repr(token))
        return token_id

    def content_hash(self) -> str:
        """SHA-256 of the canonical JSON of the vocabulary (in id order) and the special ids."""
        payload = {
            "format": _CHAR_HASH_FORMAT,
            "vocab": list(self._id_to_token),
            "special": self._special.to_json_dict(),
        }
        return _sha256_hex(_canonical_json(payload))

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self._alphabet!r}, stop_tokens={self._stop_tokens!r})"


class HFTokenizer:
    """Wrapper around a Hugging Face ``tokenizers.Tokenizer``.

    Every named token (``pad_token``, ``mask_token``, ``bos_token``, each of ``stop_tokens``)
    must already be in the vocabulary (added tokens included), otherwise a
    :class:`TokenizerError` names the argument.

    Mask-token policy: with ``add_mask_token=True`` a ``mask_token`` that is missing from the
    vocabulary is appended as a new special token (``add_special_tokens``) and receives id
    ``V``, the vocabulary size before the call, so the vocabulary grows to ``V + 1``. Existing
    ids never move, so teacher logits and embeddings indexed by the original ids stay valid. If
    the token already exists its existing id is used and nothing is added.

    ``vocab_size`` is ``get_vocab_size(with_added_tokens=True)``; ids must be dense
    (``0 .. vocab_size - 1``). ``encode`` never adds special tokens (``add_special_tokens=False``).
    ``content_hash`` covers the library's serialization re-dumped with sorted keys plus the
    special ids; it changes if the ``tokenizers`` library changes its serialization format.
    """

    #: What :class:`~distill.teacher_contract.TeacherInfo` reports as ``tokenizer_kind``.
    kind: typing.ClassVar[str] = "hf"

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        pad_token: str,
        mask_token: str,
        bos_token: str,
        stop_tokens: Sequence[str],
        add_mask_token: bool = False,
    ) -> None:
        """Wrap a copy of ``tokenizer`` (the caller's object is never mutated)."""
        if not isinstance(tokenizer, tokenizers.Tokenizer):
            raise _error("tokenizer", "be a tokenizers.Tokenizer", repr(type(tokenizer)))
        self._init(
            tokenizers.Tokenizer.from_str(tokenizer.to_str()),
            pad_token=pad_token,
            mask_token=mask_token,
            bos_token=bos_token,
            stop_tokens=stop_tokens,
            add_mask_token=add_mask_token,
        )

    def _init(
        self,
        tok: tokenizers.Tokenizer,
        *,
        pad_token: str,
        mask_token: str,
        bos_token: str,
        stop_tokens: Sequence[str],
        add_mask_token: bool,
    ) -> None:
        if not isinstance(add_mask_token, bool):
            raise _error("add_mask_token", "be a bool", repr(add_mask_token))
        for name, value in (
            ("pad_token", pad_token),
            ("mask_token", mask_token),
            ("bos_token", bos_token),
        ):
            if not isinstance(value, str) or not value:
                raise _error(name, "be a non-empty str", repr(value))
        stops = _check_stop_tokens(stop_tokens)

        def lookup(name: str, token: str) -> int:
            token_id = tok.token_to_id(token)
            if token_id is None:
                raise _error(name, "be a token in the vocabulary", f"{token!r} (not found)")
            return int(token_id)

        pad_id = lookup("pad_token", pad_token)
        bos_id = lookup("bos_token", bos_token)
        stop_ids = tuple(lookup("stop_tokens", token) for token in stops)
        if add_mask_token and tok.token_to_id(mask_token) is None:
            expected_id = tok.get_vocab_size(with_added_tokens=True)
            tok.add_special_tokens([tokenizers.AddedToken(mask_token, special=True)])
            mask_id = lookup("mask_token", mask_token)
            if mask_id != expected_id:
                raise _error(
                    "mask_token",
                    f"be appended with id {expected_id} (the previous vocab size)",
                    f"id {mask_id}",
                )
        else:
            mask_id = lookup("mask_token", mask_token)

        vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        max_id = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
        if max_id != vocab_size - 1:
            raise _error(
                "tokenizer",
                f"have dense ids 0..{vocab_size - 1}",
                f"a vocabulary whose largest id is {max_id}",
            )
        special = SpecialIds(pad_id=pad_id, mask_id=mask_id, bos_id=bos_id, stop_ids=stop_ids)
        special.validate(vocab_size)

        self._tok = tok
        self._vocab_size = vocab_size
        self._special = special
        self._skip_ids = special.special_set()
        self._tokens = {
            "pad_token": pad_token,
            "mask_token": mask_token,
            "bos_token": bos_token,
            "stop_tokens": stops,
        }

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        pad_token: str,
        mask_token: str,
        bos_token: str,
        stop_tokens: Sequence[str],
        add_mask_token: bool = False,
    ) -> HFTokenizer:
        """Load a ``tokenizer.json``; a missing or unreadable file raises naming `path`."""
        if not isinstance(path, str | os.PathLike):
            raise _error("path", "be a str or os.PathLike", repr(path))
        fspath = os.fspath(path)
        if not os.path.isfile(fspath):
            raise _error("path", "point to an existing tokenizer.json file", repr(fspath))
        try:
            tok = tokenizers.Tokenizer.from_file(fspath)
        except Exception as exc:  # the library raises a bare Exception
            raise _error("path", "be a valid tokenizers JSON file", f"{fspath!r} ({exc})") from exc
        instance = cls.__new__(cls)
        instance._init(
            tok,
            pad_token=pad_token,
            mask_token=mask_token,
            bos_token=bos_token,
            stop_tokens=stop_tokens,
            add_mask_token=add_mask_token,
        )
        return instance

    @classmethod
    def from_str(
        cls,
        json_str: str,
        *,
        pad_token: str,
        mask_token: str,
        bos_token: str,
        stop_tokens: Sequence[str],
        add_mask_token: bool = False,
    ) -> HFTokenizer:
        """Build from the text of a ``tokenizer.json``; invalid JSON raises naming `json_str`."""
        if not isinstance(json_str, str):
            raise _error("json_str", "be a str", repr(type(json_str)))
        try:
            tok = tokenizers.Tokenizer.from_str(json_str)
        except Exception as exc:  # the library raises a bare Exception
            raise _error("json_str", "be a valid tokenizers JSON document", f"error {exc}") from exc
        instance = cls.__new__(cls)
        instance._init(
            tok,
            pad_token=pad_token,
            mask_token=mask_token,
            bos_token=bos_token,
            stop_tokens=stop_tokens,
            add_mask_token=add_mask_token,
        )
        return instance

    @property
    def vocab_size(self) -> int:
        """``get_vocab_size(with_added_tokens=True)`` (after a mask token was appended)."""
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (read it, never mutate it: the special ids
        and the content hash describe it as built)."""
        return self._tok

    @property
    def special(self) -> SpecialIds:
        return self._special

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens (``add_special_tokens=False``)."""
        if not isinstance(text, str):
            raise _error("text", "be a str", repr(text))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Decode ``ids``; out-of-range ids raise naming `ids`.

        With ``skip_special=True`` the pad, mask, bos and stop ids are dropped, as are tokens the
        library itself marks special.
        """
        checked = _check_ids(ids, self._vocab_size)
        if skip_special:
            skip = self._skip_ids
            checked = [i for i in checked if i not in skip]
        return self._tok.decode(checked, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int:
        """Id of ``token`` (added tokens included)."""
        token_id = self._tok.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            raise _error("token", "be a token in the vocabulary", repr(token))
        return int(token_id)

    def content_hash(self) -> str:
        """SHA-256 of the sorted-key re-dump of ``to_str()`` plus the special ids."""
        payload = {
            "format": _HF_HASH_FORMAT,
            "tokenizer": json.loads(self._tok.to_str()),
            "special": self._special.to_json_dict(),
        }
        return _sha256_hex(_canonical_json(payload))

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self._tokens.items())
        return f"HFTokenizer(vocab_size={self._vocab_size}, {args})"


_CHAR_SPEC_KEYS: frozenset[str] = frozenset({"kind", "alphabet", "stop_tokens"})
_HF_SPEC_KEYS: frozenset[str] = frozenset(
    {"kind", "path", "pad_token", "mask_token", "bos_token", "stop_tokens", "add_mask_token"}
)
_HF_REQUIRED_KEYS: tuple[str, ...] = ("path", "pad_token", "mask_token", "bos_token", "stop_tokens")


def tokenizer_from_spec(spec: Mapping[str, Any]) -> Tokenizer:
    """Build a tokenizer from a config mapping (the ``tokenizer`` section of a config).

    ``{"kind": "char", "alphabet": ..., "stop_tokens": [...]}`` (both optional) builds a
    :class:`CharTokenizer`; ``{"kind": "hf", "path": ..., "pad_token": ..., "mask_token": ...,
    "bos_token": ..., "stop_tokens": [...], "add_mask_token": false}`` (``add_mask_token``
    optional) builds an :class:`HFTokenizer` via :meth:`HFTokenizer.from_file`. Errors name the
    offending key as `tokenizer.<key>`.
    """
    if not isinstance(spec, Mapping):
        raise _error("tokenizer", "be a mapping", repr(spec))
    for key in spec:
        if not isinstance(key, str):
            raise _error("tokenizer", "have only string keys", repr(key))
    if "kind" not in spec:
        raise _error("tokenizer.kind", "be one of 'char', 'hf'", "no value")
    kind = spec["kind"]
    if kind == "char":
        allowed = _CHAR_SPEC_KEYS
    elif kind == "hf":
        allowed = _HF_SPEC_KEYS
    else:
        raise _error("tokenizer.kind", "be one of 'char', 'hf'", repr(kind))
    for key in sorted(spec):
        if key not in allowed:
            allowed_text = ", ".join(repr(k) for k in sorted(allowed))
            raise _error(
                f"tokenizer.{key}",
                f"not be set for kind {kind!r} (allowed keys: {allowed_text})",
                repr(spec[key]),
            )
    kwargs = {key: value for key, value in spec.items() if key != "kind"}
    try:
        if kind == "char":
            return CharTokenizer(**kwargs)
        for key in _HF_REQUIRED_KEYS:
            if key not in spec:
                raise _error(f"tokenizer.{key}", "be set for kind 'hf'", "no value")
        path = kwargs.pop("path")
        return HFTokenizer.from_file(path, **kwargs)
    except TokenizerError as exc:
        message = str(exc)
        for key in spec:
            if message.startswith(f"`{key}`"):
                raise TokenizerError(f"`tokenizer.{message[1:]}") from exc
        raise
