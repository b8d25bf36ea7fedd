"""OPD batches: weights through the first stop, the teacher's view, one exact update."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from distill.config import LossConfig, ModelConfig, OptimizerConfig, RolloutConfig
from distill.data.tasks import Example
from distill.diffusion.denoise import SamplingSettings, rollout
from distill.losses import OpdLoss
from distill.models.transformer import Transformer
from distill.opd import opd_update, prepare_batch, task_rewards, teacher_sequences, teacher_top_k
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


def fresh_copy(model):
    copy = nnx.clone(model)
    nnx.update(copy, jax.tree.map(np.array, nnx.state(model)))
    return copy


def one_update(setup, loss, **prepare):
    tokenizer, teacher, student, trace = setup
    model = fresh_copy(student)
    optimizer = make_train_state(model, OptimizerConfig(learning_rate=1e-2))
    top_k = teacher_top_k(loss, teacher.info())
    prepared = prepare_batch(trace, teacher, tokenizer, top_k=top_k, **prepare)
    reference = fresh_copy(student) if loss.kl_reference_weight > 0 else None
    metrics = opd_update(optimizer, model, prepared, loss, reference=reference)
    return model, metrics


def changed(before, after):
    pairs = zip(
        jax.tree.leaves(nnx.state(before, nnx.Param)),
        jax.tree.leaves(nnx.state(after, nnx.Param)),
        strict=True,
    )
    return any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


@pytest.mark.parametrize(
    "loss",
    [
        OpdLoss(kind="forward_kl"),
        OpdLoss(kind="reverse_kl_full", teacher_top_k=5),
        OpdLoss(kind="jsd", teacher_top_k=5),
    ],
    ids=["forward_kl-full", "reverse_kl_full-top5", "jsd-top5"],
)
def test_distribution_losses_train_through_the_loop(setup, loss):
    model, metrics = one_update(setup, loss)
    assert all(np.isfinite(value) for value in metrics.values()), metrics
    assert metrics[loss.kind] > 0 and metrics["teacher_nonfinite"] == 0
    assert changed(setup[2], model)


def test_top_k_with_k_equal_to_the_vocabulary_gives_the_full_vocabulary_loss(setup):
    vocab = setup[1].info().vocab_size
    _, full = one_update(setup, OpdLoss(kind="forward_kl"))
    _, topk = one_update(setup, OpdLoss(kind="forward_kl", teacher_top_k=vocab))
    np.testing.assert_allclose(topk["forward_kl"], full["forward_kl"], rtol=1e-5)
    np.testing.assert_allclose(topk["grad_norm"], full["grad_norm"], rtol=1e-4)


def test_the_reference_kl_is_zero_when_the_reference_is_the_starting_student(setup):
    _, metrics = one_update(setup, OpdLoss(kl_reference_weight=0.5))
    assert metrics["kl_reference"] == pytest.approx(0.0, abs=1e-6)


def test_grpo_task_reward_adds_group_normalized_advantages(setup):
    rows = setup[3].tokens.shape[0]
    loss = OpdLoss(task_reward_weight=1.0, advantage="token")
    rewards = [1.0, 0.0, 0.0][:rows]
    _, with_reward = one_update(setup, loss, rewards=rewards, group_ids=[0, 0, 1][:rows])
    _, without = one_update(setup, OpdLoss(advantage="token"))
    assert with_reward["reward"] == pytest.approx(np.mean(rewards))
    assert with_reward["loss"] != pytest.approx(without["loss"])
    # Rewards that are equal within every group add nothing.
    _, flat = one_update(setup, loss, rewards=[1.0] * rows, group_ids=[0, 0, 1][:rows])
    np.testing.assert_allclose(flat["loss"], without["loss"], rtol=1e-6)


def test_the_update_refuses_a_batch_without_what_the_loss_needs(setup):
    tokenizer, teacher, student, trace = setup
    prepared = prepare_batch(trace, teacher, tokenizer)
    optimizer = make_train_state(fresh_copy(student), OptimizerConfig())
    with pytest.raises(ValueError, match="`prepared.teacher_topk_ids`"):
        opd_update(optimizer, student, prepared, OpdLoss(kind="forward_kl"))
    with pytest.raises(ValueError, match="`prepared.rewards`"):
        opd_update(optimizer, student, prepared, OpdLoss(task_reward_weight=1.0))
    with pytest.raises(ValueError, match="`reference`"):
        opd_update(optimizer, student, prepared, OpdLoss(kl_reference_weight=1.0))
    with pytest.raises(ValueError, match="`rewards`"):
        prepare_batch(trace, teacher, tokenizer, rewards=[1.0])


def test_top_k_larger_than_the_teacher_vocabulary_is_refused(setup):
    info = setup[1].info()
    with pytest.raises(ValueError, match="`loss.teacher_top_k`"):
        teacher_top_k(OpdLoss(kind="jsd", teacher_top_k=info.vocab_size + 1), info)


class FixedCompletions:
    """A stand-in for a trace's stop-cut completions (task_rewards reads nothing else)."""

    def __init__(self, completions):
        self._completions = completions

    def completions(self):
        return self._completions


def test_task_rewards_verify_each_stop_cut_completion_against_its_example():
    tokenizer = CharTokenizer()
    stop = tokenizer.special.stop_ids[0]
    examples = [
        Example("agree", "agree:3|", "aaa", 0),
        Example("agree", "agree:3|", "aaa", 1),
        Example("copy", "copy:ab|", "ab", 2),
    ]
    completions = [
        [*tokenizer.encode("ccc"), stop],  # another letter agrees too
        [*tokenizer.encode("cca"), stop],
        tokenizer.encode("ab"),  # no stop token: judged on its text, as evaluation does
    ]
    rewards = task_rewards(examples, FixedCompletions(completions), tokenizer)
    assert rewards == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="`examples`"):
        task_rewards(examples[:2], FixedCompletions(completions), tokenizer)


class NaNTopKTeacher(InProcessTeacher):
    """The in-process teacher with a NaN in every top-k answer."""

    def score(self, sequences, *, top_k=None):
        out = []
        for result in super().score(sequences, top_k=top_k):
            top = np.array(result.top_log_probs)
            top[:, 0] = np.nan
            out.append(dataclasses.replace(result, top_log_probs=top))
        return out


def test_a_nan_in_the_teachers_top_k_is_an_error_not_a_dropped_token(setup):
    tokenizer, teacher, _, trace = setup
    broken = NaNTopKTeacher(teacher.model, tokenizer)
    with pytest.raises(ValueError, match="`teacher_topk_logps` must be finite or -inf"):
        prepare_batch(trace, broken, tokenizer, top_k=4)
