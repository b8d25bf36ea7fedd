"""Bring your own teacher: load Hugging Face Llama / Qwen2 checkpoints into :class:`Transformer`.

A checkpoint directory holds ``config.json``, the weights as ``model.safetensors`` or as shards
listed in ``model.safetensors.index.json``, ``tokenizer.json`` and usually
``tokenizer_config.json`` (special tokens, chat template), ``generation_config.json`` and
``chat_template.jinja``. Only safetensors weights are read (``pytorch_model.bin`` is refused),
with the ``safetensors`` numpy API; bfloat16 tensors come back as ``ml_dtypes.bfloat16``.

Public API:

* :func:`load_teacher` -- the causal teacher and an :class:`HFCheckpoint` describing it.
* :func:`init_student` -- a ``block_diffusion`` student initialized from the same causal
  checkpoint, and its :class:`HFCheckpoint`.
* :func:`init_student_from_causal` -- the same, returning ``(model, tokenizer)``.
* :func:`read_hf_config` -- the :class:`~distill.config.ModelConfig` of a checkpoint, without
  reading weights.

Supported: ``LlamaForCausalLM`` (``model_type`` ``llama``) and ``Qwen2ForCausalLM``
(``qwen2``; q/k/v biases), grouped-query attention, ``head_dim``, ``rms_norm_eps``,
``rope_theta``, RoPE scaling ``default`` / ``linear`` / ``llama3`` (legacy ``rope_scaling`` +
``rope_theta`` or the newer ``rope_parameters``), tied or untied embeddings
(``tie_word_embeddings``), float32 / bfloat16 / float16 weights (``dtype`` or ``torch_dtype``;
float16 is widened to float32). Refused, with a :class:`CheckpointError` naming the field: other
architectures or model types, ``hidden_act`` other than ``silu``, other RoPE scalings
(``dynamic``, ``yarn``, ``longrope``, ...), ``partial_rotary_factor`` < 1, Llama
``attention_bias`` / ``mlp_bias``, Qwen2 ``use_sliding_window`` or sliding ``layer_types``,
``quantization_config``, and any missing, misshapen or unexpected weight tensor.

Mask-token policy (the student needs a mask id the teacher never had):

* The pipeline tokenizer is the teacher's tokenizer plus one appended mask token with id
  ``V`` = the teacher's vocabulary size (``config.json`` ``vocab_size``, the number of rows
  of its embedding). When the tokenizer has fewer tokens than ``V`` (embeddings padded for
  efficiency, as in Qwen2), the gap is filled with special tokens ``<|distill_reserved_i|>``
  first, so ids stay dense and every teacher logit column has a token. A tokenizer with more
  ids than ``V`` is refused. If the tokenizer already has the mask token (``mask_token``
  argument, or ``mask_token`` in ``tokenizer_config.json``), its existing id is the mask id
  and nothing is appended.
* The teacher's ids never move: the teacher model keeps ``V`` rows, and the student's
  embedding (and untied output head) gets one extra row at id ``V``, initialized to the mean
  of the teacher's rows. Every other row is the teacher's, so a student initialized from the
  checkpoint computes exactly the teacher's logits on ids ``< V``.
* The mask logit is always set to ``-inf`` before normalizing (rollout, replay, loss), so the
  extra row never changes the teacher-comparable distribution over ids ``< V``. With an
  existing in-vocabulary mask token, the teacher's logit at that id must be excluded likewise.

Student initialization (``shifted`` + ``seed_and_mask`` contract): the student keeps the
causal head -- logits at logical position ``p - 1`` predict token ``p`` -- and only its
attention pattern changes to ``block_diffusion`` with the given ``block_size``. With
``block_size=1`` it reproduces the teacher's next-token distribution exactly.

Special tokens of the returned :class:`~distill.tokenizer.HFTokenizer` (each overridable by
argument): ``bos`` from ``tokenizer_config.json`` / ``special_tokens_map.json``, else
``bos_token_id`` of ``config.json`` / ``generation_config.json``; stop tokens are the union of
``eos_token`` and every ``eos_token_id`` of those files; ``pad`` likewise, else the first stop
token; ``mask`` as above (default ``<|mask|>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tokenizers
from flax import nnx
from safetensors import safe_open

from distill.config import ConfigError, ModelConfig
from distill.models.transformer import Transformer
from distill.tokenizer import HFTokenizer, TokenizerError

__all__ = [
    "DEFAULT_MASK_TOKEN",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "HFCheckpoint",
    "init_student",
    "init_student_from_causal",
    "load_teacher",
    "read_hf_config",
]

#: Mask token appended to the teacher's tokenizer unless it already has one.
DEFAULT_MASK_TOKEN = "<|mask|>"
#: Name of the placeholder tokens that fill a tokenizer up to the embedding's row count.
RESERVED_TOKEN = "<|distill_reserved_{}|>"
#: ``architectures`` entry -> ``model_type`` accepted with it.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = types.MappingProxyType(
    {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
)

_WEIGHTS_HASH_FORMAT = "distill.hf-weights/v1"
_SAFETENSORS_DTYPES: Mapping[str, np.dtype] = types.MappingProxyType(
    {
        "F32": np.dtype(np.float32),
        "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "F64": np.dtype(np.float64),
    }
)
_CHECKPOINT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}
_IGNORED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded faithfully. Messages read "`field` must ...; received ..."."""


def _error(field: str, must: str, received: Any, where: str | os.PathLike[str] | None = None):
    suffix = f" (in {os.fspath(where)})" if where is not None else ""
    return CheckpointError(f"`{field}` must {must}; received {received!r}{suffix}")


# ---- public API ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    """What was loaded from a checkpoint directory.

    ``model_config`` is the config of the returned model (teacher: ``causal`` with
    ``teacher_vocab_size`` ids; student: ``block_diffusion`` with one more id when the mask
    was appended). ``tokenizer`` is the pipeline tokenizer shared by teacher and student (mask
    included; ``tokenizer.vocab_size`` may exceed the teacher's by one). ``weights_hash`` is a
    hex SHA-256 over the tensors sorted by name (name, dtype, shape, raw bytes): independent of
    sharding and file metadata, changed by any weight change. ``chat_template`` is the default
    Jinja chat template, or ``None``. ``hf_config`` is ``config.json`` as read.
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
    checkpoint_dtype: str
    hf_config: Mapping[str, Any]


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
) -> tuple[Transformer, HFCheckpoint]:
    """Load the causal teacher in ``path``.

    ``param_dtype`` defaults to the checkpoint's (float16 becomes float32); ``dtype``
    (computation) defaults to ``param_dtype``; ``max_length`` defaults to
    ``max_position_embeddings``. The token arguments override what the checkpoint's files say
    (see the module docstring).
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
) -> tuple[Transformer, HFCheckpoint]:
    """A ``block_diffusion`` student with ``block_size`` initialized from the causal checkpoint.

    For the ``shifted`` + ``seed_and_mask`` contract: the causal head is kept (logits at
    position ``p - 1`` predict token ``p``). The embedding (and an untied output head) gains
    the mask row at id ``teacher_vocab_size`` (the mean of the teacher's rows) unless the
    tokenizer already has the mask token. Arguments as in :func:`load_teacher`.
    """
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


def init_student_from_causal(
    checkpoint_dir: str | os.PathLike[str], block_size: int, **kwargs: Any
) -> tuple[Transformer, HFTokenizer]:
    """:func:`init_student` returning ``(model, tokenizer with the mask token)``."""
    model, checkpoint = init_student(checkpoint_dir, block_size, **kwargs)
    return model, checkpoint.tokenizer


def read_hf_config(
    path: str | os.PathLike[str],
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    max_length: int | None = None,
) -> tuple[str, ModelConfig, str]:
    """``(architecture, teacher ModelConfig, checkpoint dtype)`` from ``config.json`` alone.

    Raises :class:`CheckpointError` naming the field for anything unsupported.
    """
    directory = _directory(path)
    hf_config = _read_json(directory / "config.json", required=True)
    return _model_config(
        hf_config,
        directory / "config.json",
        param_dtype=param_dtype,
        dtype=dtype,
        max_length=max_length,
    )


def load_tokenizer(
    path: str | os.PathLike[str],
    *,
    mask_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    stop_tokens: Sequence[str] | None = None,
) -> HFTokenizer:
    """The teacher's tokenizer of the checkpoint in ``path`` without reading its weights (a
    client of a teacher server needs only this). Arguments as in :func:`load_teacher`."""
    directory = _directory(path)
    hf = _read_json(directory / "config.json", required=True)
    _, config, _ = _model_config(
        hf, directory / "config.json", param_dtype=None, dtype=None, max_length=None
    )
    tokens = dict(
        mask_token=mask_token, pad_token=pad_token, bos_token=bos_token, stop_tokens=stop_tokens
    )
    return _tokenizer(directory, hf, config.vocab_size, tokens)[0]


# ---- config.json -----------------------------------------------------------------------------


def _directory(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise _error("path", "be a str or os.PathLike", path)
    directory = Path(path)
    if not directory.is_dir():
        raise _error("path", "be a checkpoint directory", os.fspath(path))
    return directory


def _read_json(file: Path, *, required: bool = False) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise _error("path", f"contain {file.name}", os.fspath(file.parent))
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _error(file.name, "be a readable JSON file", f"{exc}", file) from exc
    if not isinstance(data, dict):
        raise _error(file.name, "hold a JSON object", type(data).__name__, file)
    return data


def _architecture(hf: Mapping[str, Any], where: Path) -> str:
    model_type = hf.get("model_type")
    supported_types = sorted(set(SUPPORTED_ARCHITECTURES.values()))
    if model_type not in supported_types:
        raise _error("model_type", f"be one of {supported_types}", model_type, where)
    architectures = hf.get("architectures")
    if architectures is None:
        return next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type)
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or architectures[0] not in SUPPORTED_ARCHITECTURES
    ):
        raise _error(
            "architectures",
            f"be one of {[[name] for name in SUPPORTED_ARCHITECTURES]}",
            architectures,
            where,
        )
    architecture = architectures[0]
    if SUPPORTED_ARCHITECTURES[architecture] != model_type:
        raise _error(
            "model_type",
            f"be {SUPPORTED_ARCHITECTURES[architecture]!r} for {architecture}",
            model_type,
            where,
        )
    return architecture


def _rope_fields(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """ModelConfig RoPE fields from ``rope_parameters`` (new) or ``rope_scaling`` (legacy)."""
    field, rope = "rope_parameters", hf.get("rope_parameters")
    if rope is None:
        field, rope = "rope_scaling", hf.get("rope_scaling")
    rope = {} if rope is None else rope
    if not isinstance(rope, Mapping):
        raise _error(field, "be a mapping or null", rope, where)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind is None:
        kind = "default"
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise _error("rope_theta", "be a positive number", theta, where)
    for name, value in (
        (f"{field}.partial_rotary_factor", rope.get("partial_rotary_factor")),
        ("partial_rotary_factor", hf.get("partial_rotary_factor")),
    ):
        if value is not None and value != 1.0:
            raise _error(name, "be 1.0 (partial rotary embeddings are not supported)", value, where)
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    supported = ["default", "linear", "llama3"]
    if kind not in supported:
        raise _error(
            f"{field}.rope_type",
            f"be one of {supported} (other RoPE scalings are not implemented)",
            kind,
            where,
        )

    def number(key: str, default: Any = None) -> float:
        value = rope.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise _error(
                f"{field}.{key}", f"be a positive number for {kind!r} scaling", value, where
            )
        return value

    if kind == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=float(number("factor")))
    elif kind == "llama3":
        original = number("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if int(original) != original:
            raise _error(f"{field}.original_max_position_embeddings", "be an int", original, where)
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(number("factor")),
            rope_low_freq_factor=float(number("low_freq_factor")),
            rope_high_freq_factor=float(number("high_freq_factor")),
            rope_original_max_position=int(original),
        )
    return fields


def _int_field(hf: Mapping[str, Any], key: str, where: Path, default: Any = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _error(key, "be a positive int", value, where)
    return value


def _model_config(
    hf: Mapping[str, Any],
    where: Path,
    *,
    param_dtype: str | None,
    dtype: str | None,
    max_length: int | None,
) -> tuple[str, ModelConfig, str]:
    architecture = _architecture(hf, where)
    model_type = SUPPORTED_ARCHITECTURES[architecture]
    if hf.get("hidden_act", "silu") != "silu":
        raise _error("hidden_act", "be 'silu' (SwiGLU)", hf.get("hidden_act"), where)
    if hf.get("quantization_config") is not None:
        raise _error("quantization_config", "be absent (quantized weights)", "a config", where)
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key, False):
                raise _error(
                    key, "be false (Llama projection biases are not supported)", True, where
                )
        attention_bias = False
    else:
        if hf.get("use_sliding_window", False):
            raise _error(
                "use_sliding_window",
                "be false (sliding-window attention is not supported)",
                hf.get("use_sliding_window"),
                where,
            )
        layer_types = hf.get("layer_types")
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            raise _error("layer_types", "be all 'full_attention'", layer_types, where)
        attention_bias = True
    dtype_key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    checkpoint_dtype = hf.get(dtype_key) or "float32"
    if checkpoint_dtype not in _CHECKPOINT_DTYPES:
        raise _error(dtype_key, f"be one of {sorted(_CHECKPOINT_DTYPES)}", checkpoint_dtype, where)
    for name, value in (("param_dtype", param_dtype), ("dtype", dtype)):
        if value not in (None, "float32", "bfloat16"):
            raise _error(name, "be None, 'float32' or 'bfloat16'", value)
    param_dtype = param_dtype or _CHECKPOINT_DTYPES[checkpoint_dtype]
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _error("tie_word_embeddings", "be a bool", tie, where)
    n_heads = _int_field(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    max_position = _int_field(hf, "max_position_embeddings", where, default=2048)
    fields = dict(
        vocab_size=_int_field(hf, "vocab_size", where),
        d_model=_int_field(hf, "hidden_size", where),
        n_layers=_int_field(hf, "num_hidden_layers", where),
        n_heads=n_heads,
        n_kv_heads=n_heads
        if hf.get("num_key_value_heads") is None
        else _int_field(hf, "num_key_value_heads", where),
        head_dim=None if head_dim is None else _int_field(hf, "head_dim", where),
        d_ff=_int_field(hf, "intermediate_size", where),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=tie,
        param_dtype=param_dtype,
        dtype=dtype or param_dtype,
        attention_type="causal",
        max_length=max_length or max_position,
        init_std=hf.get("initializer_range", 0.02),
        attention_bias=attention_bias,
        **_rope_fields(hf, where),
    )
    try:
        config = ModelConfig(**fields)
    except ConfigError as exc:
        raise CheckpointError(f"{exc} (converted from {os.fspath(where)})") from exc
    return architecture, config, checkpoint_dtype


# ---- weights ---------------------------------------------------------------------------------


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """Shard file name -> tensor names it holds (from the index, or the single file)."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise _error("weight_map", "map tensor names to shard files", weight_map, index_file)
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or "/" in file or file.startswith("."):
                raise _error("weight_map", "name shard files in the directory", file, index_file)
            files.setdefault(file, []).append(name)
        for file in files:
            if not (directory / file).is_file():
                raise _error("weight_map", "name existing shard files", file, index_file)
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="np") as handle:
            return {single.name: list(handle.keys())}
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise _error(
        "path",
        "contain model.safetensors or model.safetensors.index.json (safetensors only)",
        found or os.fspath(directory),
    )


def _iter_tensors(directory: Path) -> Iterator[tuple[str, np.ndarray, str]]:
    """Yield ``(name, array, safetensors dtype)`` for every tensor in name order, one at a time
    (so the weights hash does not depend on how the tensors are sharded)."""
    files = _weight_files(directory)
    owner = {name: file for file, names in files.items() for name in names}
    with contextlib.ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(directory / file, framework="np"))
            for file in sorted(files)
        }
        available = {file: set(handle.keys()) for file, handle in handles.items()}
        for name in sorted(owner):
            file, handle = owner[name], handles[owner[name]]
            if name not in available[file]:
                raise _error("weight_map", f"list only tensors present in {file}", name)
            code = handle.get_slice(name).get_dtype()
            expected = _SAFETENSORS_DTYPES.get(code)
            if expected is None:
                raise _error(
                    name, f"have a float dtype in {sorted(_SAFETENSORS_DTYPES)}", code, file
                )
            array = handle.get_tensor(name)
            if array.dtype != expected:  # e.g. bfloat16 read without ml_dtypes
                raise _error(name, f"load as {expected}", str(array.dtype), file)
            yield name, array, code


def _param_path(name: str) -> tuple[tuple[str | int, ...], bool] | None:
    """Our parameter path for a Hugging Face tensor name, and whether it is transposed."""
    if name == "model.embed_tokens.weight":
        return ("embed", "embedding"), False
    if name == "model.norm.weight":
        return ("final_norm", "scale"), False
    if name == "lm_head.weight":
        return ("lm_head", "kernel"), True
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    simple = {
        "input_layernorm.weight": (("input_norm", "scale"), False),
        "post_attention_layernorm.weight": (("post_attention_norm", "scale"), False),
    }
    if rest in simple:
        sub, transposed = simple[rest]
        return ("layers", layer, *sub), transposed
    match = re.fullmatch(r"(self_attn|mlp)\.(\w+_proj)\.(weight|bias)", rest)
    if match is None:
        return None
    block = "attention" if match.group(1) == "self_attn" else "mlp"
    kind = "kernel" if match.group(3) == "weight" else "bias"
    return ("layers", layer, block, match.group(2), kind), kind == "kernel"


def _load_weights(
    directory: Path, abstract: Mapping[tuple, jax.ShapeDtypeStruct], param_dtype: str
) -> tuple[dict[tuple, jax.Array], str]:
    """Read, map, transpose and cast every tensor; return params by path and the weights hash."""
    digest = hashlib.sha256(_WEIGHTS_HASH_FORMAT.encode())
    target = jnp.dtype(param_dtype)
    params: dict[tuple, jax.Array] = {}
    tied = ("lm_head", "kernel") not in abstract
    for name, array, code in _iter_tensors(directory):
        header = json.dumps([name, code, list(array.shape)], separators=(",", ":"))
        digest.update(len(header).to_bytes(8, "little") + header.encode())
        digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        if _IGNORED_TENSOR.fullmatch(name) or (tied and name == "lm_head.weight"):
            continue  # a non-persistent RoPE buffer, or the duplicate of a tied embedding
        mapped = _param_path(name)
        if mapped is None or mapped[0] not in abstract:
            raise _error(name, "be a tensor of the declared architecture", "an unexpected tensor")
        path, transposed = mapped
        value = array.T if transposed else array
        expected = tuple(abstract[path].shape)
        if value.shape != expected:
            expected = expected[::-1] if transposed else expected
            raise _error(name, f"have shape {expected}", tuple(array.shape))
        params[path] = jnp.asarray(value.astype(target, copy=False))
    missing = sorted(".".join(map(str, path)) for path in abstract if path not in params)
    if missing:
        raise _error("path", "hold every weight of the architecture", f"missing {missing}")
    return params, digest.hexdigest()


def _build(config: ModelConfig, params: Mapping[tuple, jax.Array]) -> Transformer:
    """A Transformer of ``config`` whose parameters are ``params`` (no random init)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    for path, variable in nnx.to_flat_state(state):
        variable.set_value(params[path])
    return nnx.merge(graphdef, state)


def _abstract_params(config: ModelConfig) -> dict[tuple, jax.ShapeDtypeStruct]:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(abstract))}


def _append_mask_row(params: dict[tuple, jax.Array], tied: bool) -> None:
    """Give the embedding (and an untied head) one more id, initialized to the mean row."""
    embedding = params[("embed", "embedding")]
    mean = jnp.mean(embedding.astype(jnp.float32), axis=0, keepdims=True)
    params[("embed", "embedding")] = jnp.concatenate([embedding, mean.astype(embedding.dtype)], 0)
    if not tied:
        kernel = params[("lm_head", "kernel")]
        mean = jnp.mean(kernel.astype(jnp.float32), axis=1, keepdims=True)
        params[("lm_head", "kernel")] = jnp.concatenate([kernel, mean.astype(kernel.dtype)], 1)


# ---- tokenizer -------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tokenizer(
    directory: Path,
    hf: Mapping[str, Any],
    teacher_vocab: int,
    overrides: Mapping[str, Any],
) -> tuple[HFTokenizer, bool, str | None]:
    """The pipeline tokenizer (mask included), whether the mask was appended, chat template."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise _error("path", "contain tokenizer.json", os.fspath(directory))
    try:
        tok = tokenizers.Tokenizer.from_file(os.fspath(tokenizer_file))
    except Exception as exc:  # the library raises a bare Exception
        raise _error("tokenizer.json", "be a valid tokenizers file", str(exc)) from exc
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    special_map = _read_json(directory / "special_tokens_map.json")
    generation = _read_json(directory / "generation_config.json")

    def named(key: str) -> str | None:
        return _token_text(tokenizer_config.get(key)) or _token_text(special_map.get(key))

    def by_ids(key: str) -> list[str]:
        found = []
        for source in (hf, generation):
            for token_id in _ids(source.get(key)):
                token = tok.id_to_token(token_id)
                if token is not None and token not in found:
                    found.append(token)
        return found

    size = tok.get_vocab_size(with_added_tokens=True)
    if size > teacher_vocab:
        raise _error(
            "vocab_size",
            f"cover the tokenizer's {size} ids (config.json has fewer embedding rows)",
            teacher_vocab,
        )
    if size < teacher_vocab:
        # Fill unused embedding rows so ids stay dense and the mask gets id teacher_vocab.
        reserved = [RESERVED_TOKEN.format(i) for i in range(size, teacher_vocab)]
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in reserved])
        if tok.get_vocab_size(with_added_tokens=True) != teacher_vocab:
            raise _error("tokenizer.json", "accept reserved filler tokens", "a name clash")

    stops = list(overrides["stop_tokens"] or [])
    if not stops:
        for token in [named("eos_token"), *by_ids("eos_token_id")]:
            if token is not None and token not in stops:
                stops.append(token)
    bos = overrides["bos_token"] or named("bos_token") or next(iter(by_ids("bos_token_id")), None)
    pad = (
        overrides["pad_token"]
        or named("pad_token")
        or next(iter(by_ids("pad_token_id")), None)
        or (stops[0] if stops else None)
    )
    mask = overrides["mask_token"] or named("mask_token") or DEFAULT_MASK_TOKEN
    for field, value in (("bos_token", bos), ("stop_tokens", stops), ("pad_token", pad)):
        if not value:
            raise _error(field, "be given: the checkpoint's files do not name one", value)
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
        raise CheckpointError(f"{exc} (tokenizer of {os.fspath(directory)})") from exc
    if appended and tokenizer.special.mask_id != teacher_vocab:
        raise _error("mask_token", f"get id {teacher_vocab}", tokenizer.special.mask_id)
    return tokenizer, appended, _chat_template(directory, tokenizer_config)


# ---- loading ---------------------------------------------------------------------------------


def _load(
    path: str | os.PathLike[str],
    *,
    attention_type: str,
    block_size: int | None,
    param_dtype: str | None,
    dtype: str | None,
    max_length: int | None,
    tokens: Mapping[str, Any],
) -> tuple[Transformer, HFCheckpoint]:
    directory = _directory(path)
    hf = _read_json(directory / "config.json", required=True)
    architecture, teacher_config, checkpoint_dtype = _model_config(
        hf, directory / "config.json", param_dtype=param_dtype, dtype=dtype, max_length=max_length
    )
    teacher_vocab = teacher_config.vocab_size
    tokenizer, appended, chat_template = _tokenizer(directory, hf, teacher_vocab, tokens)
    params, weights_hash = _load_weights(
        directory, _abstract_params(teacher_config), teacher_config.param_dtype
    )
    config = teacher_config
    if attention_type != "causal":
        updates: dict[str, Any] = {"attention_type": attention_type, "block_size": block_size}
        if appended:
            updates["vocab_size"] = teacher_vocab + 1
            _append_mask_row(params, teacher_config.tie_embeddings)
        config = ModelConfig(**(teacher_config.model_dump() | updates))
    model = _build(config, params)
    checkpoint = HFCheckpoint(
        path=os.fspath(directory.resolve()),
        architecture=architecture,
        model_config=config,
        tokenizer=tokenizer,
        teacher_vocab_size=teacher_vocab,
        mask_id=tokenizer.special.mask_id,
        mask_appended=appended,
        weights_hash=weights_hash,
        chat_template=chat_template,
        checkpoint_dtype=checkpoint_dtype,
        hf_config=types.MappingProxyType(dict(hf)),
    )
    return model, checkpoint
