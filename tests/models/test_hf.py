"""Hugging Face Llama / Qwen2 checkpoints against their torch reference implementations."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tokenizers
from flax import nnx
from safetensors.numpy import save_file

from distill.models.hf import (
    CheckpointError,
    init_student,
    init_student_from_causal,
    load_teacher,
    read_hf_config,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 100  # embedding rows; the tokenizer has 98 tokens, so 2 reserved fillers precede the mask
WORDS = [f"w{i}" for i in range(94)]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
TOL = dict(atol=1e-4, rtol=1e-4)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500_000.0,
}


def write_tokenizer(directory, specials=("<unk>", "<s>", "</s>", "<pad>"), mask_token=None):
    vocab = {token: index for index, token in enumerate([*specials, *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}
    config["chat_template"] = CHAT_TEMPLATE
    if mask_token is not None:
        config["mask_token"] = mask_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def common(**overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    return fields | overrides


def save_reference(factory, name, config, *, seed, dtype=None, shard=None, also_single=False):
    """Build a random torch model once, save it (+ tokenizer); return (model, directory)."""
    torch.manual_seed(seed)
    model_class = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[config.model_type]
    model = model_class(config).eval()
    with torch.no_grad():  # default init zeroes biases and sets norms to 1: randomize all
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    directory = factory.mktemp(name)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_tokenizer(directory)
    if also_single:
        single = factory.mktemp(f"{name}_single")
        model.save_pretrained(single, safe_serialization=True)
        write_tokenizer(single)
        return model, directory, single
    return model, directory


@pytest.fixture(scope="module")
def llama_untied(tmp_path_factory):
    config = transformers.LlamaConfig(**common(tie_word_embeddings=False))
    return save_reference(
        tmp_path_factory, "llama_untied", config, seed=0, shard="40KB", also_single=True
    )


@pytest.fixture(scope="module")
def llama_tied_llama3(tmp_path_factory):
    config = transformers.LlamaConfig(**common(tie_word_embeddings=True, rope_parameters=LLAMA3))
    return save_reference(tmp_path_factory, "llama_llama3", config, seed=1)


@pytest.fixture(scope="module")
def llama_linear_head_dim(tmp_path_factory):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}
    config = transformers.LlamaConfig(
        **common(tie_word_embeddings=False, head_dim=8, rope_parameters=rope, rms_norm_eps=1e-5)
    )
    return save_reference(tmp_path_factory, "llama_linear", config, seed=2)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    config = transformers.Qwen2Config(
        **common(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-5,
            use_sliding_window=False,
        )
    )
    return save_reference(tmp_path_factory, "qwen2", config, seed=3)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    config = transformers.LlamaConfig(**common(tie_word_embeddings=False))
    return save_reference(tmp_path_factory, "llama_bf16", config, seed=4, dtype=torch.bfloat16)


@nnx.jit
def forward(model, tokens, positions):
    return model(tokens, positions, jnp.ones_like(tokens))


def random_layout(seed, batch=2, length=12, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    starts = rng.integers(0, 60, (batch, 1))  # past llama3's original 32 positions
    positions = (starts + np.arange(length)).astype(np.int32)
    return tokens, positions


def torch_logits(model, tokens, positions):
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.float().numpy()


@pytest.mark.parametrize(
    "fixture", ["llama_untied", "llama_tied_llama3", "llama_linear_head_dim", "qwen2"]
)
def test_teacher_logits_match_torch(fixture, request):
    reference, directory, *_ = request.getfixturevalue(fixture)
    model, checkpoint = load_teacher(directory)
    assert model.config.attention_type == "causal"
    assert model.config.vocab_size == checkpoint.teacher_vocab_size == VOCAB
    assert model.config.tie_embeddings == reference.config.tie_word_embeddings
    tokens, positions = random_layout(0)
    ours = forward(model, jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(ours), torch_logits(reference, tokens, positions), **TOL)


def test_config_fields_are_converted(llama_tied_llama3, llama_linear_head_dim, qwen2):
    _, llama3_config, dtype = read_hf_config(llama_tied_llama3[1])
    assert dtype == "float32"
    assert (llama3_config.rope_scaling, llama3_config.rope_scaling_factor) == ("llama3", 8.0)
    assert llama3_config.rope_original_max_position == 32
    assert llama3_config.rope_theta == 500_000.0 and llama3_config.tie_embeddings
    _, linear_config, _ = read_hf_config(llama_linear_head_dim[1])
    assert linear_config.head_dim == 8 and linear_config.norm_eps == 1e-5
    assert (linear_config.rope_scaling, linear_config.rope_scaling_factor) == ("linear", 2.0)
    architecture, qwen_config, _ = read_hf_config(qwen2[1])
    assert architecture == "Qwen2ForCausalLM" and qwen_config.attention_bias
    assert qwen_config.rope_theta == 1_000_000.0 and qwen_config.n_kv_heads == 2


def test_legacy_config_format_loads_the_same(llama_tied_llama3, tmp_path):
    """Checkpoints written by transformers 4.x: rope_theta + rope_scaling, torch_dtype."""
    reference, directory = llama_tied_llama3
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, checkpoint = load_teacher(tmp_path)
    assert checkpoint.model_config.rope_scaling == "llama3"
    tokens, positions = random_layout(1)
    ours = forward(model, jnp.asarray(tokens), jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(ours), torch_logits(reference, tokens, positions), **TOL)


def test_sharded_and_single_file_checkpoints_agree(llama_untied, qwen2):
    _, sharded, single = llama_untied
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (single / "model.safetensors.index.json").is_file()
    sharded_model, sharded_checkpoint = load_teacher(sharded)
    single_model, single_checkpoint = load_teacher(single)
    assert sharded_checkpoint.weights_hash == single_checkpoint.weights_hash
    assert load_teacher(qwen2[1])[1].weights_hash != sharded_checkpoint.weights_hash
    for a, b in zip(
        jax.tree.leaves(nnx.state(sharded_model)),
        jax.tree.leaves(nnx.state(single_model)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_tokenizer_special_tokens_and_chat_template(llama_untied):
    directory = llama_untied[1]
    _, checkpoint = load_teacher(directory)
    tokenizer = checkpoint.tokenizer
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "w3 w1 w93 w0 w3 unknown w17"
    assert tokenizer.encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer.encode("w5 w6")) == raw.decode(raw.encode("w5 w6").ids)
    special = tokenizer.special
    assert (special.bos_id, special.stop_ids, special.pad_id) == (1, (2,), 3)
    # 98 tokens + 2 reserved fillers up to the 100 embedding rows; the mask is id 100.
    assert tokenizer.vocab_size == VOCAB + 1
    assert special.mask_id == checkpoint.mask_id == VOCAB and checkpoint.mask_appended
    assert tokenizer.token_to_id("<|distill_reserved_98|>") == 98
    assert checkpoint.chat_template == CHAT_TEMPLATE
    assert checkpoint.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("fixture", ["llama_tied_llama3", "qwen2"])
def test_student_with_block_size_one_reproduces_teacher_log_probs(fixture, request):
    reference, directory = request.getfixturevalue(fixture)
    student, tokenizer = init_student_from_causal(directory, block_size=1)
    assert student.config.attention_type == "block_diffusion"
    assert student.config.block_size == 1
    assert student.config.vocab_size == VOCAB + 1 == tokenizer.vocab_size
    mask_id = tokenizer.special.mask_id
    assert mask_id == VOCAB
    tokens, positions = random_layout(2)
    logits = forward(student, jnp.asarray(tokens), jnp.asarray(positions))
    logits = logits.at[..., mask_id].set(-jnp.inf)
    student_log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))[..., :VOCAB]
    teacher_log_probs = torch.log_softmax(
        torch.from_numpy(torch_logits(reference, tokens, positions)), dim=-1
    ).numpy()
    np.testing.assert_allclose(student_log_probs, teacher_log_probs, **TOL)


def test_student_mask_row_is_the_mean_embedding(llama_untied):
    directory = llama_untied[1]
    teacher, _ = load_teacher(directory)
    student, checkpoint = init_student(directory, block_size=4)
    assert checkpoint.model_config == student.config
    assert (student.config.block_size, student.config.attention_type) == (4, "block_diffusion")
    embedding = np.asarray(student.embed.embedding[...])
    teacher_embedding = np.asarray(teacher.embed.embedding[...])
    np.testing.assert_array_equal(embedding[:VOCAB], teacher_embedding)
    np.testing.assert_allclose(embedding[VOCAB], teacher_embedding.mean(0), atol=1e-7)
    head = np.asarray(student.lm_head.kernel[...])
    assert head.shape == (64, VOCAB + 1)
    np.testing.assert_array_equal(head[:, :VOCAB], np.asarray(teacher.lm_head.kernel[...]))


def test_existing_mask_token_adds_no_row(llama_untied, tmp_path):
    shutil.copytree(llama_untied[1], tmp_path, dirs_exist_ok=True)
    specials = ("<unk>", "<s>", "</s>", "<mask>")
    vocab = {token: index for index, token in enumerate([*specials, *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    student, checkpoint = init_student(tmp_path, block_size=2)
    assert not checkpoint.mask_appended and checkpoint.mask_id == 3
    assert student.config.vocab_size == VOCAB == checkpoint.tokenizer.vocab_size
    assert checkpoint.tokenizer.special.pad_id == 2  # no pad token: the first stop token


def test_bfloat16_checkpoint_loads_bfloat16_params(llama_bf16):
    reference, directory = llama_bf16
    model, checkpoint = load_teacher(directory)
    assert checkpoint.checkpoint_dtype == "bfloat16"
    assert model.config.param_dtype == model.config.dtype == "bfloat16"
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        assert leaf.dtype == jnp.bfloat16
    expected = reference.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    kernel = np.asarray(model.layers[1].attention.q_proj.kernel[...])
    assert kernel.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(kernel.astype(np.float32), expected)
    tokens, positions = random_layout(3)
    ours = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(positions)))
    theirs = torch_logits(reference, tokens, positions)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, atol=0.05 * np.abs(theirs).max())
    as_float32, _ = load_teacher(directory, param_dtype="float32")
    assert as_float32.embed.embedding[...].dtype == jnp.float32


def base_llama_config():
    return transformers.LlamaConfig(**common()).to_dict() | {"architectures": ["LlamaForCausalLM"]}


def base_qwen2_config():
    config = transformers.Qwen2Config(**common()).to_dict()
    return config | {"architectures": ["Qwen2ForCausalLM"]}


@pytest.mark.parametrize(
    ("base", "changes", "field"),
    [
        ("llama", {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "model_type"),
        ("llama", {"architectures": ["GemmaForCausalLM"]}, "architectures"),
        ("llama", {"model_type": "qwen2"}, "model_type"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        (
            "llama",
            {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type",
        ),
        ("llama", {"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"dtype": "int8"}, "dtype"),
        ("llama", {"dtype": None, "torch_dtype": "float8"}, "torch_dtype"),
        ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_unsupported_config_is_refused_naming_the_field(base, changes, field, tmp_path):
    config = (base_llama_config() if base == "llama" else base_qwen2_config()) | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"^`{field}` must"):
        load_teacher(tmp_path)


def test_unexpected_tensor_is_refused(llama_untied, tmp_path):
    shutil.copytree(llama_untied[1], tmp_path, dirs_exist_ok=True)
    name = "model.layers.0.self_attn.o_proj.bias"
    save_file({name: np.zeros(64, np.float32)}, str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"^`{name}` must"):
        load_teacher(tmp_path)


def test_missing_weights_are_refused(llama_untied, tmp_path):
    shutil.copytree(llama_untied[2], tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="^`path` must contain model.safetensors"):
        load_teacher(tmp_path)


def test_distill_score_reads_a_checkpoint_directory(llama_untied, capsys):
    from services import cli

    directory = llama_untied[1]
    assert cli.main(["score", "--hf-checkpoint", str(directory), "w3 w1 w5", "--top-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and out.count("top:") == 3


def test_hf_teacher_is_compatible_with_its_student_with_the_appended_mask(llama_untied):
    from distill.teacher import InProcessTeacher, check_compatible

    directory = llama_untied[1]
    teacher, checkpoint = load_teacher(directory)
    student, _ = init_student(directory, block_size=4)
    info = InProcessTeacher(teacher, checkpoint.tokenizer).info()
    check_compatible(info, checkpoint.tokenizer, student.config.vocab_size)
