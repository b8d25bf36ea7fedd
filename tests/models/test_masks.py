"""Mask truth tables against a brute-force reference on random layouts."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.models import masks

LENGTH, N_CHUNKS, MAX_BLOCK = 30, 4, 4


@st.composite
def packed_layouts(draw):
    """Rows of padding + several segments (+ padding), then canvas chunks of random blocks."""
    block_size = draw(st.integers(1, 4))
    batch = 2
    rows = []
    for _ in range(batch):
        positions, segments = [], []
        left_pad = draw(st.integers(0, 3))
        # Padding slots carry arbitrary positions (including 0): they must never count.
        positions += draw(st.lists(st.integers(0, 5), min_size=left_pad, max_size=left_pad))
        segments += [0] * left_pad
        for segment in range(1, draw(st.integers(1, 3)) + 1):
            length = draw(st.integers(1, 7))
            positions += list(range(length))
            segments += [segment] * length
        right_pad = draw(st.integers(0, 2))
        positions += [0] * right_pad
        segments += [0] * right_pad
        rows.append((positions, segments))
    # Fixed shapes (padding to LENGTH slots, N_CHUNKS chunks of MAX_BLOCK slots) so the
    # whole search reuses one compilation.
    length = LENGTH
    positions = np.zeros((batch, length), np.int32)
    segments = np.zeros((batch, length), np.int32)
    for row, (p, s) in enumerate(rows):
        positions[row, : len(p)] = p
        segments[row, : len(s)] = s
    n_chunks = N_CHUNKS
    sources = -np.ones((batch, n_chunks, MAX_BLOCK), np.int32)
    for row in range(batch):
        blocks = sorted(
            {
                (int(s), int(p) // block_size)
                for p, s in zip(positions[row], segments[row], strict=True)
                if s
            }
        )
        for chunk in range(n_chunks):
            if not draw(st.booleans()):
                continue  # an all-padding chunk
            segment, block = blocks[draw(st.integers(0, len(blocks) - 1))]
            slots = [
                slot
                for slot in range(length)
                if segments[row, slot] == segment and positions[row, slot] // block_size == block
            ]
            sources[row, chunk, : len(slots)] = slots
    return block_size, positions, segments, sources


def reference_mask(positions, segments, chunks, attention_type, block_size):
    """The DESIGN rule written as loops over (query, key) pairs."""
    batch, length = positions.shape
    out = np.zeros((batch, length, length), bool)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                if segments[b, q] == 0 or segments[b, k] != segments[b, q]:
                    continue
                pq, pk = positions[b, q], positions[b, k]
                if attention_type == "causal":
                    out[b, q, k] = pk <= pq
                elif chunks[b, q] == 0:
                    out[b, q, k] = chunks[b, k] == 0 and pk // block_size <= pq // block_size
                else:
                    earlier_clean = chunks[b, k] == 0 and pk // block_size < pq // block_size
                    out[b, q, k] = earlier_clean or chunks[b, k] == chunks[b, q]
    return out


@settings(max_examples=60, deadline=None)
@given(packed_layouts(), st.sampled_from(["causal", "block_diffusion"]))
def test_clean_mask_matches_brute_force_reference(layout, attention_type):
    block_size, positions, segments, _ = layout
    got = masks.self_attention_mask(
        jnp.asarray(positions),
        jnp.asarray(segments),
        attention_type=attention_type,
        block_size=block_size,
    )
    want = reference_mask(positions, segments, np.zeros_like(positions), attention_type, block_size)
    np.testing.assert_array_equal(np.asarray(got), want)


@settings(max_examples=60, deadline=None)
@given(packed_layouts())
def test_packed_canvas_mask_matches_brute_force_reference(layout):
    block_size, positions, segments, sources = layout
    canvas = np.full(sources.shape, 7, np.int32)
    packed = masks.pack_canvas_chunks(
        jnp.zeros_like(jnp.asarray(positions)),
        jnp.asarray(positions),
        jnp.asarray(segments),
        jnp.asarray(sources),
        jnp.asarray(canvas),
    )
    packed_pos, packed_seg, packed_chunks = (
        np.asarray(packed.positions),
        np.asarray(packed.segment_ids),
        np.asarray(packed.chunk_ids),
    )
    # Chunk slots copy their source's position and segment; empty slots are padding.
    batch, length = positions.shape
    flat_sources = sources.reshape(batch, -1)
    for b in range(batch):
        for offset, source in enumerate(flat_sources[b]):
            slot = length + offset
            if source < 0:
                assert packed_seg[b, slot] == 0
            else:
                assert packed_pos[b, slot] == positions[b, source]
                assert packed_seg[b, slot] == segments[b, source]
    got = masks.self_attention_mask(
        packed.positions,
        packed.segment_ids,
        attention_type="block_diffusion",
        block_size=block_size,
        chunk_ids=packed.chunk_ids,
    )
    want = reference_mask(packed_pos, packed_seg, packed_chunks, "block_diffusion", block_size)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_block_size_one_block_diffusion_mask_equals_causal_mask():
    positions = jnp.asarray([[0, 1, 2, 0, 1, 0]])
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
    causal = masks.self_attention_mask(positions, segments, attention_type="causal", block_size=1)
    block = masks.self_attention_mask(
        positions, segments, attention_type="block_diffusion", block_size=1
    )
    np.testing.assert_array_equal(np.asarray(causal), np.asarray(block))


def test_partial_final_block_is_bidirectional_within_itself():
    positions = jnp.arange(6)[None]
    segments = jnp.ones((1, 6), jnp.int32)
    mask = np.asarray(
        masks.self_attention_mask(
            positions, segments, attention_type="block_diffusion", block_size=4
        )
    )[0]
    assert mask[4, 5] and mask[5, 4]  # positions 4, 5 form the partial block 1
    assert not mask[3, 4] and mask[4, 3]


def test_valid_token_equal_to_pad_id_stays_valid():
    # Validity comes from segments, never from token values: nothing here reads tokens.
    packed = masks.pack_canvas_chunks(
        jnp.zeros((1, 2), jnp.int32),
        jnp.asarray([[0, 1]]),
        jnp.asarray([[1, 1]]),
        jnp.asarray([[[0, 1]]]),
        jnp.zeros((1, 1, 2), jnp.int32),
    )
    assert np.asarray(packed.segment_ids).tolist() == [[1, 1, 1, 1]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"attention_type": "sliding"}, "attention_type"),
        ({"attention_type": "block_diffusion", "block_size": 0}, "block_size"),
    ],
)
def test_bad_mask_arguments_name_the_field(kwargs, field):
    arguments = {"attention_type": "causal", "block_size": 2} | kwargs
    with pytest.raises(ValueError, match=f"`{field}`"):
        masks.self_attention_mask(
            jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), **arguments
        )


def test_causal_mask_refuses_canvas_chunks():
    with pytest.raises(ValueError, match="`chunk_ids`"):
        masks.self_attention_mask(
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1, 2), jnp.int32),
            attention_type="causal",
            block_size=1,
            chunk_ids=jnp.zeros((1, 2), jnp.int32),
        )


def test_pack_canvas_chunks_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="`chunk_sources`"):
        masks.pack_canvas_chunks(
            jnp.zeros((1, 4), jnp.int32),
            jnp.zeros((1, 4), jnp.int32),
            jnp.ones((1, 4), jnp.int32),
            jnp.zeros((1, 2, 2), jnp.int32),
            jnp.zeros((1, 2, 3), jnp.int32),
        )
