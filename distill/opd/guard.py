"""The OPD regression guard: stop a run whose rollouts the teacher likes less and less.

A learning rate that suits a weak warm-up can wreck a strong one within a few steps (on
``reverse`` seed 1 the teacher's per-token log-prob of the rollouts fell from -0.07 to -1.1 in
five steps at 3e-4 and stayed there for 1500 steps; docs/quality.md). Nothing else in a run
says so until the next evaluation, and by then the checkpoints hold the damaged student. The
guard compares the mean of the last ``window`` steps' ``teacher_logp`` with the first step's
(the rollouts of the policy OPD started from, before any update) and stops the job when it
has fallen more than ``max_teacher_logp_drop`` nats. After a resume the window refills; the
start is restored from the checkpoint's progress record.
"""

from __future__ import annotations

import collections
import math

from distill.config import GuardConfig


class PolicyRegression(RuntimeError):
    """The guard stopped OPD: the teacher's log-prob of the rollouts fell too far."""


class TeacherLogpGuard:
    """Watches one run's per-step ``teacher_logp``; :meth:`observe` raises
    :class:`PolicyRegression` when the guard trips. ``start``: the first step's value, when a
    resumed run already has one (``None``: the next observed value becomes the start)."""

    def __init__(self, config: GuardConfig, start: float | None = None):
        if start is not None and not math.isfinite(start):
            raise ValueError(f"`start` must be a finite log-prob or None; received {start!r}")
        self.config = config
        self.start = start
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=config.window)

    def observe(self, step: int, teacher_logp: float) -> None:
        """Record step ``step``'s ``teacher_logp``; raise when the window's mean is more than
        the allowed drop below the start (only once the window is full)."""
        if not math.isfinite(teacher_logp):
            raise ValueError(
                f"`metrics.teacher_logp` must be finite; received {teacher_logp} at step {step}"
            )
        if self.start is None:
            self.start = teacher_logp
        self.recent.append((step, teacher_logp))
        limit = self.config.max_teacher_logp_drop
        if limit is None or len(self.recent) < self.config.window:
            return
        mean = sum(value for _, value in self.recent) / len(self.recent)
        if self.start - mean > limit:
            first, last = self.recent[0][0], self.recent[-1][0]
            raise PolicyRegression(
                f"`metrics.teacher_logp` must stay within guard.max_teacher_logp_drop={limit} "
                f"nats of its start {self.start:.4f} (the first step's rollouts); received a "
                f"mean of {mean:.4f} over steps {first}-{last}. The job stops before saving "
                f"step {last}'s update: OPD is making the student worse (a lower "
                "opd.optimizer.learning_rate or a learning-rate warm-up usually keeps it)"
            )
