"""Gathered log-probs equal the dense log-softmax, with any vocabulary chunking, to float32
precision at any logit scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distill.models.logprobs import gathered_log_probs, tempered_log_softmax


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
        return gathered_log_probs(hidden, w, targets, excluded_id=3, vocab_chunk=chunk).sum()

    def dense(w):
        logits = (hidden @ w).at[..., 3].set(-jnp.inf)
        log_probs = jax.nn.log_softmax(logits)
        return jnp.take_along_axis(log_probs, targets[..., None], -1).sum()

    want = jax.grad(dense)(weights)
    np.testing.assert_allclose(jax.grad(total)(weights, 6), want, atol=1e-5)
    np.testing.assert_allclose(jax.grad(total)(weights, None), want, atol=1e-5)


@pytest.mark.parametrize("vocab_chunk", [None, 7])
def test_k_ids_per_position_share_one_normalization(vocab_chunk):
    keys = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(keys[0], (2, 3, 8))
    weights = jax.random.normal(keys[1], (8, 30))
    ids = jax.random.randint(keys[2], (2, 3, 4), 2, 30).at[..., 0].set(29)  # 29: in the tail
    logits = (hidden @ weights).at[..., 1].set(-jnp.inf) / 0.7
    dense = jnp.take_along_axis(jax.nn.log_softmax(logits), ids, -1)
    got = gathered_log_probs(
        hidden, weights, ids, temperature=0.7, excluded_id=1, vocab_chunk=vocab_chunk
    )
    np.testing.assert_allclose(got, dense, atol=1e-5)


def float64_log_softmax(hidden, weights, temperature, excluded_id):
    logits = np.asarray(hidden, np.float64) @ np.asarray(weights, np.float64) / temperature
    logits[..., excluded_id] = -np.inf
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def dyadic(values, step):
    return jnp.round(values / step) * step


@pytest.mark.parametrize("vocab_chunk", [None, 16])
@pytest.mark.parametrize("scale", [1.0, 8.0, 73.0, 1000.0])
def test_precision_does_not_depend_on_the_logit_scale(scale, vocab_chunk):
    """Hidden states scaled so the largest logit is ``scale``, targets drawn from the
    distribution itself (as a rollout draws them): within 1e-5 of float64 at every scale.
    Inputs sit on a dyadic grid coarse enough that every float32 logit (and partial sum) is
    exact, so what is measured is the normalization alone, not the matmul's rounding."""
    keys = jax.random.split(jax.random.key(3), 2)
    weights = dyadic(jax.random.normal(keys[1], (32, 50)) / np.sqrt(32), 2.0**-8)
    base = jax.random.normal(keys[0], (4, 16, 32))
    base = base * (scale / float(jnp.max(jnp.abs(base @ weights))))
    hidden = dyadic(base, 2.0 ** (np.floor(np.log2(scale)) - 8))
    logits = np.asarray(hidden, np.float64) @ np.asarray(weights, np.float64)
    np.testing.assert_array_equal(np.asarray(hidden @ weights, np.float64), logits)  # exact
    assert 0.5 * scale < np.abs(logits).max() < 2 * scale
    want = float64_log_softmax(hidden, weights, 0.8, excluded_id=1)
    rng = np.random.default_rng(0)
    cumulative = np.exp(want).cumsum(-1)
    draws = rng.random(want.shape[:2] + (1,)) * cumulative[..., -1:]
    targets = np.minimum((cumulative < draws).sum(-1), want.shape[-1] - 1)
    assert np.any(want.max(-1) < -1e-3)  # not every row is certain: a real log-sum-exp
    got = gathered_log_probs(
        hidden,
        weights,
        jnp.asarray(targets),
        temperature=0.8,
        excluded_id=1,
        vocab_chunk=vocab_chunk,
    )
    expected = np.take_along_axis(want, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=0)
    # The full distribution, where a token could be drawn (far below, float32 is relative).
    full = np.asarray(tempered_log_softmax(hidden @ weights, 0.8, excluded_id=1))
    likely = want > -30
    np.testing.assert_allclose(full[likely], want[likely], atol=1e-5, rtol=0)
    assert np.all(full[..., 1] == -np.inf)


def test_mismatched_shapes_name_the_field():
    with pytest.raises(ValueError, match="`targets`"):
        gathered_log_probs(jnp.zeros((1, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="`output_embedding`"):
        gathered_log_probs(jnp.zeros((1, 3, 4)), jnp.zeros((3, 5)), jnp.zeros((1, 3), jnp.int32))


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 0.0, -1.0])
def test_a_temperature_that_is_not_finite_and_positive_is_refused(temperature):
    hidden, weights = np.zeros((1, 2, 4), np.float32), np.zeros((4, 5), np.float32)
    targets = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match=r"^`temperature` must be a finite number > 0"):
        gathered_log_probs(hidden, weights, targets, temperature=temperature)
    with pytest.raises(ValueError, match=r"^`temperature` must be a finite number > 0"):
        tempered_log_softmax(np.zeros((2, 5), np.float32), temperature)


@pytest.mark.parametrize("excluded_id", [-1, 5])
def test_an_excluded_id_outside_the_vocabulary_is_refused(excluded_id):
    # -1 would have excluded the last id (dense) or nothing at all (chunked).
    hidden, weights = np.zeros((1, 2, 4), np.float32), np.zeros((4, 5), np.float32)
    targets = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match=r"^`excluded_id` must be an id in \[0, 5\)"):
        gathered_log_probs(hidden, weights, targets, excluded_id=excluded_id)
    with pytest.raises(ValueError, match=r"^`excluded_id` must be an id in \[0, 5\)"):
        tempered_log_softmax(np.zeros((2, 5), np.float32), excluded_id=excluded_id)
