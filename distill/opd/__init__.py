"""On-policy distillation: rollout -> teacher score -> exact packed replay -> weighted loss
-> optax update.

- :mod:`distill.opd.batch`: batch preparation (OPD weights, teacher scores, rewards);
- :mod:`distill.opd.update`: the jitted update step;
- :mod:`distill.opd.planner_loss`: the joint token + commit-decision loss of a planner
  rollout (``rollout.commit_rule: planner``), with the per-forward cost;
- :mod:`distill.opd.records`: a rollout as data that crosses processes (policy version,
  identity, numpy), and merging a step's parts from several workers;
- :mod:`distill.opd.guard`: the regression guard that stops a run making the student worse;
- :mod:`distill.opd.learner`: :class:`OpdLearner` (contract, ledger, staleness, checks,
  evaluations, checkpoints) and the in-process loop :func:`run_opd` that composes them.
The distributed runtime (``services/``) runs the same learner with rollouts from workers.
"""

from distill.opd.batch import (
    PreparedBatch,
    prepare_batch,
    task_rewards,
    teacher_sequences,
    teacher_top_k,
)
from distill.opd.guard import PolicyRegression, TeacherLogpGuard
from distill.opd.learner import (
    NonFiniteError,
    OpdLearner,
    StaleRollout,
    load_weights,
    rollout_settings,
    run_opd,
    student_weights,
)
from distill.opd.planner_loss import JointLoss
from distill.opd.records import RolloutBatch, merge_batches
from distill.opd.update import frozen_copy, opd_update

__all__ = [
    "JointLoss",
    "NonFiniteError",
    "OpdLearner",
    "PolicyRegression",
    "PreparedBatch",
    "RolloutBatch",
    "StaleRollout",
    "TeacherLogpGuard",
    "frozen_copy",
    "load_weights",
    "merge_batches",
    "opd_update",
    "prepare_batch",
    "rollout_settings",
    "run_opd",
    "student_weights",
    "task_rewards",
    "teacher_sequences",
    "teacher_top_k",
]
