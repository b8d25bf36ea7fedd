"""OPD microbatch accumulation: row slices replayed and differentiated one at a time give
the whole batch's update (to float32 rounding), including the batch-wide advantage
baselines (return-to-go, sequence) and GRPO groups kept whole."""

import jax
import numpy as np
import pytest
from flax import nnx

from distill import pipeline
from distill.losses import OpdLoss
from distill.opd.batch import prepare_batch, task_rewards, teacher_top_k
from distill.opd.learner import OpdLearner
from distill.opd.update import frozen_copy, opd_update
from distill.teacher import InProcessTeacher
from tests.support.fakes import tiny_job, tiny_models


@pytest.fixture(scope="module")
def setup():
    # One layer each: slicing rows and summing weighted sums do not depend on depth, and
    # each (loss, microbatch count) below is a compile of its own.
    job = tiny_job(
        "data.batch_size=4", "loss.group_size=2", "student.n_layers=1", "teacher.n_layers=1"
    )
    teacher_model, student = tiny_models(job)
    tokenizer = pipeline.job_tokenizer(job)
    teacher = InProcessTeacher(teacher_model, tokenizer)
    learner = OpdLearner(job, student, teacher, tokenizer, log=lambda _: None)
    batch = learner.roll_out()
    return job, learner, teacher, tokenizer, batch


def updated(setup, loss, microbatches):
    job, learner, teacher, tokenizer, batch = setup
    student = frozen_copy(learner.student)
    optimizer = pipeline.phase_train_state(student, job.opd)
    trace = batch.to_trace()
    rewards = group_ids = None
    if loss.task_reward_weight > 0:
        rewards = task_rewards(learner.step_examples(0), trace, tokenizer)
        rewards = [float(row % 3 == 0) for row in range(len(rewards))]  # make groups differ
        group_ids = [row // 2 for row in range(len(rewards))]
    prepared = prepare_batch(
        trace,
        teacher,
        tokenizer,
        top_k=teacher_top_k(loss, teacher.info()),
        rewards=rewards,
        group_ids=group_ids,
    )
    reference = frozen_copy(learner.student) if loss.kl_reference_weight > 0 else None
    metrics = opd_update(
        optimizer, student, prepared, loss, reference=reference, microbatches=microbatches
    )
    params = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(student, nnx.Param))]
    return metrics, params


# Each count is one more compile of the whole update (~10 s on CPU): two counts for one loss,
# the four-way split (2 rows each, the most accumulation) for the others.
@pytest.mark.parametrize(
    ("loss", "counts"),
    [
        (OpdLoss(advantage="mean_to_go", ppo_clip=0.2), (2, 4)),
        (OpdLoss(advantage="sequence"), (4,)),
        (
            OpdLoss(
                kind="forward_kl",
                teacher_top_k=8,
                task_reward_weight=1.0,
                kl_reference_weight=0.1,
            ),
            (4,),
        ),
    ],
    ids=["reverse_kl-mean_to_go", "reverse_kl-sequence", "forward_kl-topk-grpo-k3"],
)
def test_microbatches_give_the_whole_batch_update(setup, loss, counts):
    job, learner, *_ = setup
    start = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(learner.student, nnx.Param))]
    whole_metrics, whole = updated(setup, loss, 1)
    # Adam scales every element's step to about the learning rate, so float32 rounding in a
    # near-zero gradient element shows at that scale: compare steps to 1% of it.
    tolerance = 0.01 * job.opd.optimizer.learning_rate
    for microbatches in counts:
        metrics, params = updated(setup, loss, microbatches)
        np.testing.assert_allclose(metrics["loss"], whole_metrics["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-4)
        for got, want, before in zip(params, whole, start, strict=True):
            np.testing.assert_allclose(got - before, want - before, atol=tolerance)


def test_microbatches_must_divide_the_rows(setup):
    with pytest.raises(ValueError, match="`microbatches` must divide the batch's 8 rows"):
        updated(setup, OpdLoss(), 3)
