"""Training curves: TensorBoard event files written per step and read back exactly once."""

from __future__ import annotations

import dataclasses

import pytest

from distill.curves import CurveWriter, read_curves


@dataclasses.dataclass(frozen=True)
class Report:
    overall: float
    tokens_per_forward: float
    agree_entropy_bits: float | None = None


def write(directory, steps, *, scale=1.0, resume_step=0):
    writer = CurveWriter(directory, resume_step=resume_step)
    for step in steps:
        writer.scalars("train", {"loss": step * scale}, step)
    writer.close()


def test_each_step_reads_back_once_in_step_order(tmp_path):
    write(tmp_path, [1, 2, 3])
    assert read_curves(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 3.0)]}


def test_a_resumed_run_hides_what_the_crashed_run_wrote_after_its_checkpoint(tmp_path):
    write(tmp_path, [1, 2, 3, 4, 5])  # crashed after step 5, last checkpoint at step 2
    write(tmp_path, [3, 4], scale=10.0, resume_step=2)  # the rerun stops early at step 4
    assert read_curves(tmp_path) == {"train/loss": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]}


def test_non_finite_values_are_skipped_and_evaluations_are_written_once(tmp_path):
    writer = CurveWriter(tmp_path, resume_step=2)
    writer.scalars("opd", {"loss": float("nan"), "kl": 0.5}, 3)
    reports = [(0, Report(0.1, 1.0)), (4, Report(0.9, 2.5, 2.9))]
    writer.evaluations(reports)
    writer.evaluations(reports)  # nothing new
    writer.close()
    assert read_curves(tmp_path) == {
        "eval/agree_entropy_bits": [(4, pytest.approx(2.9))],
        "eval/exact_match": [(4, pytest.approx(0.9))],
        "eval/tokens_per_forward": [(4, 2.5)],
        "opd/kl": [(3, 0.5)],
    }


def test_a_missing_directory_reads_as_no_curves(tmp_path):
    assert read_curves(tmp_path / "missing") == {}


@pytest.mark.parametrize("resume_step", [-1, 1.5, True])
def test_a_bad_resume_step_is_refused_by_name(tmp_path, resume_step):
    with pytest.raises(ValueError, match="`resume_step` must be a non-negative integer"):
        CurveWriter(tmp_path, resume_step=resume_step)
