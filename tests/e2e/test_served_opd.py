"""OPD through the real teacher server: `distill opd --teacher-server` against a gRPC teacher on
loopback trains the same student as `distill opd --teacher-run` (the in-process teacher), under
the same run contract (the server's Info reports the same model hash)."""

import json

import jax
import numpy as np
from flax import nnx

from distill import pipeline
from distill.checkpoint import RunCheckpointer
from distill.config import JobConfig, load_config
from distill.teacher import InProcessTeacher, model_hash
from services import cli
from services.teacher.server import serve_teacher
from tests.support.fakes import TINY_MODELS, TINY_PHASES, set_args

OVERRIDES = [*TINY_MODELS, *TINY_PHASES, "opd.steps=2"]
SETS = set_args(*OVERRIDES)


def opd_params(job, run_dir, start):
    student = pipeline.Transformer(job.student, rngs=nnx.Rngs(0))
    nnx.update(student, jax.tree.map(np.array, nnx.state(start)))
    optimizer = pipeline.phase_train_state(student, job.opd)
    contract = json.loads((run_dir / "contract.json").read_text())
    checkpointer = RunCheckpointer.open(run_dir, contract)
    assert checkpointer.restore_latest((optimizer, student)).step == 2
    checkpointer.close()
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(student, nnx.Param))]


def test_opd_through_the_teacher_server_matches_the_in_process_teacher(tmp_path):
    job = load_config("deploy/configs/tiny.yaml", JobConfig, OVERRIDES)
    config = ["deploy/configs/tiny.yaml", *SETS, "--quiet"]
    teacher_run, student_run = tmp_path / "teacher", tmp_path / "student"
    assert cli.main(["train-teacher", *config, "--run-dir", str(teacher_run)]) == 0
    assert cli.main(["warmup-student", *config, "--run-dir", str(student_run)]) == 0
    opd = ["opd", *config, "--student-run", str(student_run)]

    local = tmp_path / "local"
    assert cli.main([*opd, "--teacher-run", str(teacher_run), "--run-dir", str(local)]) == 0

    teacher_model = pipeline.load_teacher_run(job, teacher_run)
    teacher = InProcessTeacher(teacher_model, pipeline.job_tokenizer(job))
    served = tmp_path / "served"
    with serve_teacher(teacher) as server:
        args = [*opd, "--teacher-server", server.address, "--run-dir", str(served)]
        assert cli.main(args) == 0

    local_contract = json.loads((local / "contract.json").read_text())
    assert json.loads((served / "contract.json").read_text()) == local_contract
    assert local_contract["teacher_hash"] == model_hash(teacher_model)
    start = pipeline.load_student_run(job, student_run)
    for got, want in zip(
        opd_params(job, served, start), opd_params(job, local, start), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_opd_needs_exactly_one_teacher(tmp_path, capsys):
    args = ["opd", "deploy/configs/tiny.yaml", "--run-dir", str(tmp_path)]
    assert cli.main([*args, "--student-run", str(tmp_path / "s")]) == 2
    assert "`--teacher-run` or `--teacher-server` must be given" in capsys.readouterr().err
