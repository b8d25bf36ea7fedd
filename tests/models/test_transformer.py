"""The decoder: attention patterns, packed canvases, packing, caching, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.config import ModelConfig
from distill.models import masks
from distill.models.kv_cache import KVCache
from distill.models.transformer import Transformer

VOCAB, BLOCK = 37, 4
TOL = dict(atol=1e-5, rtol=1e-5)


def make_model(**overrides) -> Transformer:
    fields = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    config = ModelConfig(**(fields | {"block_size": BLOCK, "init_std": 0.2} | overrides))
    return Transformer(config, rngs=nnx.Rngs(0))


@nnx.jit
def forward(model, tokens, positions, segment_ids, chunk_ids=None):
    return model(tokens, positions, segment_ids, chunk_ids=chunk_ids)


@nnx.jit(static_argnames="write")
def decode(model, tokens, positions, segment_ids, cache, write_index, write=True):
    return model.decode(
        tokens, positions, segment_ids, cache, write_index=write_index if write else None
    )


@pytest.fixture(scope="module")
def student():
    return make_model(attention_type="block_diffusion")


@pytest.fixture(scope="module")
def teacher():
    return make_model(attention_type="causal")


def simple_row(length, batch=2, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    return tokens, positions, jnp.ones((batch, length), jnp.int32)


def test_block_size_one_gives_causal_logits():
    causal = make_model(attention_type="causal")
    block_one = make_model(attention_type="block_diffusion", block_size=1)
    tokens, positions, segments = simple_row(11)
    np.testing.assert_allclose(
        forward(causal, tokens, positions, segments),
        forward(block_one, tokens, positions, segments),
        **TOL,
    )


def test_later_blocks_do_not_change_a_blocks_logits(student):
    tokens, positions, segments = simple_row(14)
    base = forward(student, tokens, positions, segments)
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 5) % VOCAB)  # blocks 2 and 3
    after = forward(student, changed, positions, segments)
    np.testing.assert_allclose(base[:, :8], after[:, :8], **TOL)
    assert not np.allclose(base[:, 8:], after[:, 8:])


def test_tokens_inside_a_block_see_each_other_both_ways(student):
    tokens, positions, segments = simple_row(12)
    base = forward(student, tokens, positions, segments)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 3) % VOCAB)  # last slot of block 1
    after = forward(student, changed, positions, segments)
    assert np.abs(np.asarray(base[:, 4] - after[:, 4])).max() > 1e-4  # earlier slot, block 1
    np.testing.assert_allclose(base[:, :4], after[:, :4], **TOL)  # block 0 untouched


def test_packed_canvas_chunk_equals_single_sequence_with_that_canvas(student):
    length, mask_id = 13, 1  # blocks 0..3, block 3 partial (position 12)
    tokens, positions, segments = simple_row(length, batch=2, seed=3)
    rng = np.random.default_rng(0)
    chunk_blocks = [1, 2, 3, 1]  # block 1 twice, with different canvases
    sources = np.full((2, len(chunk_blocks), BLOCK), -1, np.int32)
    canvases = np.zeros((2, len(chunk_blocks), BLOCK), np.int32)
    for chunk, block in enumerate(chunk_blocks):
        slots = [s for s in range(length) if s // BLOCK == block]
        sources[:, chunk, : len(slots)] = slots
        for row in range(2):
            clean = np.asarray(tokens[row, slots])
            masked = rng.random(len(slots)) < 0.5
            canvases[row, chunk, : len(slots)] = np.where(masked, mask_id, clean)
    packed = masks.pack_canvas_chunks(
        tokens, positions, segments, jnp.asarray(sources), jnp.asarray(canvases)
    )
    packed_logits = forward(
        student, packed.tokens, packed.positions, packed.segment_ids, packed.chunk_ids
    )
    # The clean prefix is unaffected by the chunks after it.
    np.testing.assert_allclose(
        packed_logits[:, :length], forward(student, tokens, positions, segments), **TOL
    )
    for chunk, block in enumerate(chunk_blocks):
        slots = [s for s in range(length) if s // BLOCK == block]
        single = tokens.at[:, slots].set(jnp.asarray(canvases[:, chunk, : len(slots)]))
        reference = forward(student, single, positions, segments)
        offset = length + chunk * BLOCK
        np.testing.assert_allclose(
            packed_logits[:, offset : offset + len(slots)], reference[:, slots], **TOL
        )


@pytest.mark.parametrize("kind", ["causal", "block_diffusion"])
def test_two_packed_segments_equal_two_separate_rows(kind, student, teacher):
    model = student if kind == "block_diffusion" else teacher
    first, second = 7, 6
    tokens = jax.random.randint(jax.random.key(5), (1, first + second), 0, VOCAB)
    positions = jnp.concatenate([jnp.arange(first), jnp.arange(second)])[None]
    segments = jnp.asarray([[1] * first + [2] * second])
    packed = forward(model, tokens, positions, segments)
    alone_1 = forward(model, tokens[:, :first], positions[:, :first], segments[:, :first])
    alone_2 = forward(
        model, tokens[:, first:], positions[:, first:], jnp.ones((1, second), jnp.int32)
    )
    np.testing.assert_allclose(packed[:, :first], alone_1, **TOL)
    np.testing.assert_allclose(packed[:, first:], alone_2, **TOL)


def test_left_padding_is_inert_whatever_the_pad_tokens(student):
    tokens, positions, segments = simple_row(9, batch=1)
    pad = 3
    padded_segments = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), segments], 1)
    padded_positions = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), positions], 1)
    reference = forward(student, tokens, positions, segments)
    for pad_token in (0, 5):
        padded_tokens = jnp.concatenate([jnp.full((1, pad), pad_token), tokens], 1)
        logits = forward(student, padded_tokens, padded_positions, padded_segments)
        np.testing.assert_allclose(logits[:, pad:], reference, **TOL)


def test_teacher_token_by_token_cached_decoding_equals_full_recompute(teacher):
    length = 10
    tokens, positions, segments = simple_row(length)
    full = forward(teacher, tokens, positions, segments)
    cache = KVCache.init(teacher.config, batch_size=2, capacity=length)
    prompt = 3  # a prefill of 3 tokens, then one token at a time
    logits, cache = decode(
        teacher, tokens[:, :prompt], positions[:, :prompt], segments[:, :prompt], cache, 0
    )
    steps = [logits]
    for slot in range(prompt, length):
        logits, cache = decode(
            teacher,
            tokens[:, slot : slot + 1],
            positions[:, slot : slot + 1],
            segments[:, slot : slot + 1],
            cache,
            slot,
        )
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **TOL)


def test_student_block_by_block_cached_decoding_equals_full_recompute(student):
    # Left-padded rows of different prompt lengths share slot indices; logical positions
    # are shifted by whole blocks so physical windows coincide with logical blocks.
    length = 14
    tokens, positions, segments = simple_row(length)
    segments = segments.at[1, :4].set(0)
    positions = positions.at[1].set(jnp.maximum(jnp.arange(length) - 4, 0))
    full = forward(student, tokens, positions, segments)
    cache = KVCache.init(student.config, batch_size=2, capacity=16)
    for start in range(0, length, BLOCK):
        window = slice(start, min(start + BLOCK, length))
        args = (tokens[:, window], positions[:, window], segments[:, window])
        # A denoising step (no write) then the committed block (write): same logits.
        peek, unchanged = decode(student, *args, cache, start, write=False)
        logits, cache = decode(student, *args, cache, start)
        np.testing.assert_array_equal(unchanged.segment_ids, unchanged.segment_ids)
        valid = np.asarray(segments[:, window]) != 0
        np.testing.assert_allclose(np.asarray(peek)[valid], np.asarray(logits)[valid], **TOL)
        np.testing.assert_allclose(
            np.asarray(logits)[valid], np.asarray(full[:, window])[valid], **TOL
        )


def test_cache_write_index_out_of_range_is_refused(student):
    cache = KVCache.init(student.config, batch_size=1, capacity=4)
    tokens, positions, segments = simple_row(2, batch=1)
    with pytest.raises(ValueError, match="`write_index`"):
        student.decode(tokens, positions, segments, cache, write_index=3)


def test_untied_bfloat16_model_runs_and_is_finite():
    model = make_model(tie_embeddings=False, param_dtype="bfloat16", dtype="bfloat16")
    assert model.lm_head is not None
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    tokens, positions, segments = simple_row(6)
    logits = forward(model, tokens, positions, segments)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_output_embedding_maps_hidden_states_to_logits(student):
    tokens, positions, segments = simple_row(5)
    hidden = student.hidden_states(tokens, positions, segments)
    np.testing.assert_allclose(
        hidden @ student.output_embedding(), student(tokens, positions, segments), **TOL
    )


@pytest.mark.parametrize(
    ("name", "shape"), [("positions", (2, 4)), ("segment_ids", (2, 4)), ("chunk_ids", (2, 4))]
)
def test_layout_shape_mismatch_names_the_field(student, name, shape):
    tokens, positions, segments = simple_row(5)
    arguments = {"positions": positions, "segment_ids": segments, "chunk_ids": None}
    arguments[name] = jnp.zeros(shape, jnp.int32)
    with pytest.raises(ValueError, match=f"`{name}`"):
        student(tokens, **arguments)
