"""Gathered log-probs equal the dense log-softmax, with any vocabulary chunking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.models.logprobs import gathered_log_probs


@pytest.mark.parametrize("vocab_chunk", [None, 7, 16, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gathered_log_probs_equal_dense_log_softmax(vocab_chunk, temperature):
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (2, 5, 8))
    weights = jax.random.normal(keys[1], (8, 30))
    targets = jax.random.randint(keys[2], (2, 5), 2, 30)
    logits = (hidden @ weights).at[..., 1].set(-jnp.inf) / temperature
    dense = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    got = gathered_log_probs(
        hidden, weights, targets, temperature=temperature, excluded_id=1, vocab_chunk=vocab_chunk
    )
    np.testing.assert_allclose(got, dense, atol=1e-5)


def test_gradients_match_the_dense_path():
    keys = jax.random.split(jax.random.key(1), 3)
    hidden = jax.random.normal(keys[0], (1, 4, 8))
    weights = jax.random.normal(keys[1], (8, 20))
    targets = jax.random.randint(keys[2], (1, 4), 0, 20)

    def total(w, chunk):
        return gathered_log_probs(hidden, w, targets, vocab_chunk=chunk).sum()

    np.testing.assert_allclose(
        jax.grad(total)(weights, 6), jax.grad(total)(weights, None), atol=1e-5
    )


def test_mismatched_shapes_name_the_field():
    with pytest.raises(ValueError, match="`targets`"):
        gathered_log_probs(jnp.zeros((1, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="`output_embedding`"):
        gathered_log_probs(jnp.zeros((1, 3, 4)), jnp.zeros((3, 5)), jnp.zeros((1, 3), jnp.int32))
