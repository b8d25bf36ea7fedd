"""OPD batches: weights through the first stop, the teacher's view, one exact update."""

import jax
import numpy as np
import pytest
from flax import nnx

from distill.config import LossConfig, ModelConfig, OptimizerConfig, RolloutConfig
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.losses import OpdLoss
from distill.models.transformer import Transformer
from distill.opd import opd_update, prepare_batch, teacher_sequences
from distill.teacher import InProcessTeacher
from distill.tokenizer import CharTokenizer
from distill.train import make_train_state


class RecordingTeacher(InProcessTeacher):
    """The in-process teacher, remembering what it was asked to score."""

    def score(self, sequences, *, top_k=None):
        self.seen = [list(sequence) for sequence in sequences]
        return super().score(sequences, top_k=top_k)


@pytest.fixture(scope="module")
def setup():
    tokenizer = CharTokenizer()
    common = dict(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    teacher = RecordingTeacher(
        Transformer(ModelConfig(**common, attention_type="causal"), rngs=nnx.Rngs(0)), tokenizer
    )
    student = Transformer(ModelConfig(**common, block_size=4, init_std=0.15), rngs=nnx.Rngs(1))
    stop = tokenizer.special.stop_ids[0]
    # Make the stop token likely so rows stop inside their completion.
    student.embed.embedding[...] = student.embed.embedding[...].at[stop].multiply(12.0)
    config = RolloutConfig(max_completion_length=10, threshold=0.0, stop_when_done=False)
    settings = SamplingSettings.from_config(config, tokenizer.special)
    prompts = [tokenizer.encode(text) for text in ("copy:ab|", "agree:3|", "sort:cba|")]
    trace = rollout(student, prompts, settings, seed=0, global_step=0)
    return tokenizer, teacher, student, trace


def test_weights_stop_at_the_first_stop_token_and_the_teacher_sees_nothing_after(setup):
    tokenizer, teacher, _, trace = setup
    prepared = prepare_batch(trace, teacher, tokenizer)
    stop = tokenizer.special.stop_ids[0]
    weights = np.asarray(prepared.weights)
    tokens, completion = np.asarray(trace.tokens), np.asarray(trace.completion_mask)
    assert trace.stopped().any()
    for row in range(tokens.shape[0]):
        generated = tokens[row][completion[row]]
        row_weights = weights[row][completion[row]]
        if stop in generated:
            first = int(np.argmax(generated == stop))
            assert (row_weights[: first + 1] == 1).all() and (row_weights[first + 1 :] == 0).all()
            assert teacher.seen[row][-1] == stop and teacher.seen[row].count(stop) == 1
        else:
            assert (row_weights == 1).all()
    assert not np.asarray(prepared.invalid_rows).any()


def test_teacher_log_probs_land_on_the_scored_tokens(setup):
    tokenizer, teacher, _, trace = setup
    prepared = prepare_batch(trace, teacher, tokenizer)
    weights = np.asarray(prepared.weights)
    visible = weights > 0
    sequences = teacher_sequences(trace, np.asarray(trace.segment_ids) != 0)
    positions = np.asarray(trace.positions)
    for row, scored in enumerate(teacher.score(sequences)):
        slots = np.flatnonzero(visible[row])
        np.testing.assert_allclose(
            np.asarray(prepared.teacher_logps)[row, slots],
            scored.log_probs[positions[row, slots] - 1],
            atol=1e-6,
        )


def test_one_opd_update_changes_the_student_and_reports_finite_metrics(setup):
    tokenizer, teacher, student, trace = setup
    model = nnx.clone(student)
    nnx.update(model, jax.tree.map(np.array, nnx.state(student)))
    before = [np.asarray(leaf).copy() for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]
    optimizer = make_train_state(model, OptimizerConfig(learning_rate=1e-2))
    prepared = prepare_batch(trace, teacher, tokenizer)
    metrics = opd_update(optimizer, model, prepared, OpdLoss.from_config(LossConfig()))
    assert all(np.isfinite(value) for value in metrics.values())
    assert metrics["invalid_rows"] == 0 and abs(metrics["ratio"] - 1.0) < 1e-4
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after, strict=True))


def test_the_loop_refuses_loss_kinds_it_does_not_wire_yet(setup):
    tokenizer, teacher, student, trace = setup
    prepared = prepare_batch(trace, teacher, tokenizer)
    optimizer = make_train_state(nnx.clone(student), OptimizerConfig())
    with pytest.raises(ValueError, match="`loss.kind`"):
        opd_update(optimizer, student, prepared, OpdLoss(kind="forward_kl"))
