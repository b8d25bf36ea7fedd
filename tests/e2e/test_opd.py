"""Slow: OPD on `agree` (decoded in one forward per completion at temperature 1).

From a warmed-up student whose independent parallel samples almost never agree, a seeded
in-process OPD run with the length-normalized return-to-go advantage (``mean_to_go``, the
default) reaches >= 95% exact match; per-token advantages do not (the first letter is
rewarded for staying uniform, the cost lands on later letters), and the summed return-to-go
collapses onto an immediate stop token here (fewer negative log-ratios to sum). Job:
deploy/configs/agree.yaml, seed 0, with the rollouts pinned to one forward (threshold 0; the
job's default rolls out adaptively at 0.9).
"""

import jax
import pytest
from flax import nnx

from distill import opd, pipeline
from distill.config import JobConfig, load_config
from distill.teacher import InProcessTeacher

STEPS = 60


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    job = load_config(
        "deploy/configs/agree.yaml", JobConfig, [f"opd.steps={STEPS}", "rollout.threshold=0.0"]
    )
    run = tmp_path_factory.mktemp("agree")
    silent = dict(progress=False, log=lambda _: None)
    teacher, _ = pipeline.train_teacher(job, run / "teacher", **silent)
    student, _ = pipeline.warmup_student(job, run / "student", **silent)
    return job, teacher, student, pipeline.job_tokenizer(job)


def distill(warmed, advantage):
    job, teacher, student, tokenizer = warmed
    copy = nnx.clone(student)
    nnx.update(copy, jax.tree.map(jax.numpy.copy, nnx.state(student)))
    job = job.model_copy(update={"loss": job.loss.model_copy(update={"advantage": advantage})})
    _, reports = opd.run_opd(
        job,
        copy,
        InProcessTeacher(teacher, tokenizer),
        tokenizer,
        progress=False,
        log=lambda _: None,
    )
    return reports


@pytest.mark.slow
def test_mean_to_go_opd_fixes_one_forward_decoding_of_agree(warmed):
    reports = distill(warmed, "mean_to_go")
    (_, before), (_, after) = reports[0], reports[-1]
    assert before.tokens_per_forward == after.tokens_per_forward >= 4.0
    assert before.overall < 0.2
    assert after.overall >= 0.95, after


@pytest.mark.slow
def test_per_token_advantages_do_not_fix_it(warmed):
    _, after = distill(warmed, "token")[-1]
    assert after.overall < 0.5, after
