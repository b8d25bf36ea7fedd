"""Teacher autoregressive sampling with the KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.config import ModelConfig
from distill.models.sampling import sample_causal
from distill.models.transformer import Transformer


@pytest.fixture(scope="module")
def teacher():
    config = ModelConfig(
        vocab_size=23,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="causal",
        init_std=0.2,
    )
    return Transformer(config, rngs=nnx.Rngs(0))


def test_greedy_cached_sampling_equals_argmax_of_full_recompute(teacher):
    prompts, new_tokens = [[5, 6, 7], [8]], 6
    sample = sample_causal(
        teacher,
        prompts,
        max_new_tokens=new_tokens,
        key=jax.random.key(0),
        pad_id=0,
        stop_ids=(3,),
        excluded_ids=(1,),
        greedy=True,
    )
    # One uncached forward over each prompt + its sampled tokens (right padding, which no
    # causal query sees): every sampled token must be the argmax after the tokens before it,
    # so, step by step, the sample is the greedy decode recomputed without the cache.
    width = max(len(prompt) for prompt in prompts) + new_tokens
    tokens = np.zeros((len(prompts), width), np.int32)
    segments = np.zeros_like(tokens)
    for row, prompt in enumerate(prompts):
        sequence = [*prompt, *np.asarray(sample.tokens[row]).tolist()]
        tokens[row, : len(sequence)] = sequence
        segments[row, : len(sequence)] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    logits = teacher(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    logits = logits.at[..., 1].set(-jnp.inf)
    log_probs = np.asarray(jax.nn.log_softmax(logits))
    for row, prompt in enumerate(prompts):
        for step in range(new_tokens):
            at = len(prompt) - 1 + step  # the logits that predict the step's token
            expected = int(np.argmax(log_probs[row, at]))
            assert sample.tokens[row, step] == expected
            np.testing.assert_allclose(
                sample.log_probs[row, step], log_probs[row, at, expected], atol=1e-5
            )


def test_excluded_ids_are_never_sampled_and_completions_cut_at_stop(teacher):
    sample = sample_causal(
        teacher,
        [[5, 6]] * 8,
        max_new_tokens=12,
        key=jax.random.key(1),
        pad_id=0,
        stop_ids=(3,),
        excluded_ids=(1, 2),
    )
    assert not np.isin(sample.tokens, [1, 2]).any()
    for row, ids in zip(sample.tokens.tolist(), sample.completions(), strict=True):
        if 3 in row:
            assert ids == row[: row.index(3) + 1]
        else:
            assert ids == row


def test_sampling_refuses_a_block_diffusion_model_and_bad_arguments(teacher):
    student = Transformer(
        ModelConfig(vocab_size=23, d_model=32, n_heads=4, n_kv_heads=2), rngs=nnx.Rngs(0)
    )
    common = dict(key=jax.random.key(0), pad_id=0, stop_ids=(3,))
    with pytest.raises(ValueError, match="`model.attention_type`"):
        sample_causal(student, [[5]], max_new_tokens=2, **common)
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        sample_causal(teacher, [[5]], max_new_tokens=0, **common)
    with pytest.raises(ValueError, match="`prompts`"):
        sample_causal(teacher, [[]], max_new_tokens=2, **common)


def test_sampling_refuses_a_non_finite_temperature_and_a_negative_excluded_id(teacher):
    common = dict(key=jax.random.key(0), pad_id=0, stop_ids=(3,), max_new_tokens=2)
    for temperature in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^`temperature` must be a finite number > 0"):
            sample_causal(teacher, [[5]], temperature=temperature, **common)
    with pytest.raises(ValueError, match=r"^`excluded_ids` must hold ids in \[0, 23\)"):
        sample_causal(teacher, [[5]], excluded_ids=(-1,), **common)
