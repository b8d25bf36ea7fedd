"""Teacher scoring: position i scores token i+1; compatibility refused before training."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distill.config import ModelConfig
from distill.models.transformer import Transformer
from distill.teacher import CompatibilityError, InProcessTeacher, check_compatible
from distill.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def teacher():
    tokenizer = CharTokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention_type="causal",
        init_std=0.2,
    )
    return InProcessTeacher(Transformer(config, rngs=nnx.Rngs(0)), tokenizer)


def test_score_gives_the_log_prob_of_each_actual_next_token(teacher):
    sequences = [[2, 5, 6, 7, 3], [2, 9, 10]]
    scored = teacher.score(sequences, top_k=3)
    for sequence, result in zip(sequences, scored, strict=True):
        tokens = jnp.asarray([sequence])
        positions = jnp.arange(len(sequence))[None]
        logits = teacher.model(tokens, positions, jnp.ones_like(tokens))[0]
        log_probs = jax.nn.log_softmax(logits)
        expected = [float(log_probs[i, sequence[i + 1]]) for i in range(len(sequence) - 1)]
        np.testing.assert_allclose(result.log_probs, expected, atol=1e-5)
        assert result.top_ids.shape == (len(sequence) - 1, 3)
        np.testing.assert_allclose(
            result.top_log_probs[:, 0], np.asarray(log_probs.max(-1))[:-1], atol=1e-5
        )


@pytest.mark.parametrize(
    ("sequences", "field"),
    [([], "sequences"), ([[2]], "sequences.0."), ([[2, 99]], "sequences.0.")],
)
def test_bad_score_requests_name_the_field(teacher, sequences, field):
    with pytest.raises(ValueError, match=f"`{field}"):
        teacher.score(sequences)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"vocab_size": 52}, "teacher.vocab_size"),
        ({"mask_id": 7}, "teacher.mask_id"),
        ({"stop_ids": (9,)}, "teacher.stop_ids"),
        ({"tokenizer_hash": "0" * 64}, "teacher.tokenizer_hash"),
    ],
)
def test_mismatched_teacher_is_refused_before_training(teacher, change, field):
    info = dataclasses.replace(teacher.info(), **change)
    with pytest.raises(CompatibilityError, match=f"`{field}`"):
        check_compatible(info, teacher.tokenizer, teacher.model.config.vocab_size)
    check_compatible(teacher.info(), teacher.tokenizer, teacher.model.config.vocab_size)


def test_the_teacher_contract_imports_without_jax():
    # A gRPC client or a service that only checks teachers must not pay for JAX.
    code = "import sys, distill.teacher_contract; assert 'jax' not in sys.modules, 'jax loaded'"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
