"""Which rows rollout workers generate, with which policy version, and when a step is
complete: the learner's work scheduler (pure Python; thread-safe).

Each OPD step's rows are cut into ``shards_per_step`` contiguous ranges; a worker that asks
for work gets the lowest outstanding shard whose policy version is published. The version a
step is rolled out with is a function of the step alone,
``rollout_version(t) = max(t - max_staleness, start_step)``, so a resumed run regenerates
exactly the rollouts it would have made, whatever the timing: with ``max_staleness: 0``
rollout and update alternate (step t is rolled out with the parameters after update t-1);
with ``1`` step t+1 is rolled out while step t trains.

A delivered shard is kept until its step trains. A shard whose policy version is more than
``max_staleness`` behind the step is dropped, counted and handed out again; a delivery of
work that is not outstanding (already delivered, never assigned, or an already trained
step) is refused and counted. A shard assigned longer than ``reassign_after_s`` ago goes
back to the queue (its worker may have died); if the first worker delivers after all, the
second delivery is refused, so every row trains exactly once. A worker works on one shard at
a time, so one that asks for work while still holding a shard has lost it (it was restarted
after a crash): that shard goes back to the queue at once, without waiting for
``reassign_after_s``. A worker known to be gone for good (its slice was preempted) has its
shards handed out again at once through :meth:`WorkScheduler.release`, and gets no more.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence

from distill.opd.records import RolloutBatch


class WorkKind(enum.Enum):
    WORK = "work"
    WAIT = "wait"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class Shard:
    step: int
    row_start: int
    row_count: int


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What :meth:`WorkScheduler.acquire` answers: WORK with the shard, its rows' stream
    positions and the policy version to roll out with; or WAIT / DONE."""

    kind: WorkKind
    shard: Shard | None = None
    stream_positions: tuple[int, ...] = ()
    policy_version: int = 0


class Delivery(enum.Enum):
    ACCEPTED = "accepted"
    STALE = "dropped_stale"
    REFUSED = "refused"


def shard_bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    """``(row_start, row_count)`` of ``shards`` contiguous, near-equal ranges of ``rows``."""
    if shards < 1:
        raise ValueError(f"`shards` must be >= 1; received {shards}")
    shards = min(shards, rows)
    base, extra = divmod(rows, shards)
    bounds, start = [], 0
    for index in range(shards):
        count = base + (1 if index < extra else 0)
        bounds.append((start, count))
        start += count
    return bounds


@dataclasses.dataclass
class SchedulerCounts:
    """Rows kept, dropped as stale and refused; shards handed out again because their
    worker went silent (``reassigned_shards``) or asked again while holding them, i.e. was
    restarted (``released_shards``)."""

    accepted_rows: int = 0
    dropped_stale_rows: int = 0
    refused_rows: int = 0
    reassigned_shards: int = 0
    released_shards: int = 0


class WorkScheduler:
    """See the module docstring. ``stream_positions(step)`` gives the stream position of each
    of a step's rows; ``clock`` is injectable for tests."""

    def __init__(
        self,
        *,
        start_step: int,
        end_step: int,
        rows_per_step: int,
        shards_per_step: int,
        max_staleness: int,
        stream_positions: Callable[[int], Sequence[int]],
        reassign_after_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 <= start_step <= end_step:
            raise ValueError(
                f"`start_step` must be in [0, end_step={end_step}]; received {start_step}"
            )
        if max_staleness < 0:
            raise ValueError(f"`max_staleness` must be >= 0; received {max_staleness}")
        if not reassign_after_s > 0:
            raise ValueError(f"`reassign_after_s` must be > 0; received {reassign_after_s}")
        self.start_step, self.end_step = start_step, end_step
        self.max_staleness = max_staleness
        self.bounds = shard_bounds(rows_per_step, shards_per_step)
        self._positions = stream_positions
        self._reassign_after_s = reassign_after_s
        self._clock = clock
        self._condition = threading.Condition()
        self._published = start_step  # the live policy version (= the next step to train)
        self._next_step = start_step  # lowest step whose shards were never all handed out
        self._queue: list[Shard] = []  # shards to hand out again (dropped or reassigned)
        self._assigned: dict[Shard, float] = {}
        self._holders: dict[Shard, str] = {}  # who holds an assigned shard ("" unknown)
        self._delivered: dict[int, dict[Shard, RolloutBatch]] = {}
        self._closed: str | None = None
        self._gone: set[str] = set()  # workers released for good: never given work again
        self.counts = SchedulerCounts()

    # ---- versions ------------------------------------------------------------------------

    def rollout_version(self, step: int) -> int:
        """The policy version step ``step`` is rolled out with (module docstring)."""
        return max(step - self.max_staleness, self.start_step)

    @property
    def trained_step(self) -> int:
        """The next step to train (= the published policy version)."""
        return self._published

    def publish(self, version: int) -> None:
        """Version ``version`` is published: steps before it are trained."""
        with self._condition:
            if version < self._published:
                raise ValueError(
                    f"`version` must not go back from {self._published}; received {version}"
                )
            for step in range(self._published, version):
                self._delivered.pop(step, None)
            self._published = version
            self._condition.notify_all()

    def close(self, reason: str) -> None:
        """Stop handing out work (every later :meth:`acquire` answers DONE) and wake
        every waiter; ``reason`` is what :meth:`wait_step` raises with."""
        with self._condition:
            self._closed = reason
            self._condition.notify_all()

    # ---- workers -------------------------------------------------------------------------

    def _expire(self) -> None:
        now = self._clock()
        for shard, since in list(self._assigned.items()):
            if now - since > self._reassign_after_s:
                del self._assigned[shard]
                self._holders.pop(shard, None)
                self._queue.append(shard)
                self.counts.reassigned_shards += 1

    def _release(self, worker_id: str) -> None:
        """Hand out again every shard ``worker_id`` holds (it asks for work, so it lost them)."""
        if not worker_id:
            return
        for shard, holder in list(self._holders.items()):
            if holder == worker_id:
                del self._holders[shard]
                self._assigned.pop(shard, None)
                self._queue.append(shard)
                self.counts.released_shards += 1

    def release(self, worker_id: str) -> int:
        """Hand out again at once every shard ``worker_id`` holds (the worker is gone for
        good, e.g. its node was removed); returns how many. A late delivery of one of them
        is refused like any work that is not outstanding, and the worker, should it still ask
        for work (its process not yet dead), is answered DONE."""
        if not worker_id:
            raise ValueError(f"`worker_id` must be a non-empty worker id; received {worker_id!r}")
        with self._condition:
            self._gone.add(worker_id)
            before = self.counts.released_shards
            self._release(worker_id)
            self._condition.notify_all()
            return self.counts.released_shards - before

    def _work(self, shard: Shard, worker_id: str = "") -> Assignment:
        self._assigned[shard] = self._clock()
        self._holders[shard] = worker_id
        positions = self._positions(shard.step)[shard.row_start : shard.row_start + shard.row_count]
        return Assignment(
            WorkKind.WORK, shard, tuple(int(p) for p in positions), self.rollout_version(shard.step)
        )

    def acquire(self, wait_s: float = 0.0, worker_id: str = "") -> Assignment:
        """The next shard whose rollout version is published, else WAIT (or DONE). With
        ``wait_s`` > 0 a WAIT is held back up to that long for work to appear (a long poll:
        a worker learns of a new version as soon as it is published, without polling).
        ``worker_id`` (stable across a worker's restarts): any shard it still holds is
        handed out again first (module docstring)."""
        deadline = time.monotonic() + wait_s
        with self._condition:
            self._release(worker_id)
            while True:
                assignment = self._try_acquire(worker_id)
                remaining = deadline - time.monotonic()
                if assignment.kind is not WorkKind.WAIT or remaining <= 0:
                    return assignment
                self._condition.wait(remaining)

    def _try_acquire(self, worker_id: str = "") -> Assignment:
        with self._condition:
            if (
                self._closed is not None
                or self._published >= self.end_step
                or worker_id in self._gone
            ):
                return Assignment(WorkKind.DONE)
            self._expire()
            self._queue.sort(key=lambda shard: (shard.step, shard.row_start))
            for index, shard in enumerate(self._queue):
                if self.rollout_version(shard.step) <= self._published:
                    del self._queue[index]
                    return self._work(shard, worker_id)
            step = self._next_step
            if step < self.end_step and self.rollout_version(step) <= self._published:
                handed = {s.row_start for s in self._assigned if s.step == step}
                handed |= {s.row_start for s in self._delivered.get(step, {})}
                handed |= {s.row_start for s in self._queue if s.step == step}
                for start, count in self.bounds:
                    if start not in handed:
                        if len(handed) + 1 == len(self.bounds):
                            self._next_step = step + 1
                        return self._work(Shard(step, start, count), worker_id)
                self._next_step = step + 1
                return self._try_acquire(worker_id)
            return Assignment(WorkKind.WAIT)

    def deliver(self, batch: RolloutBatch) -> Delivery:
        """Keep ``batch`` (one assigned shard's rows, already validated) for its step."""
        rows = sorted(int(row) for row in batch.row_ids)
        shard = Shard(batch.step, rows[0], len(rows)) if rows else None
        with self._condition:
            valid = (
                shard is not None
                and shard in self._assigned
                and rows == list(range(shard.row_start, shard.row_start + shard.row_count))
            )
            if not valid:
                self.counts.refused_rows += len(rows)
                return Delivery.REFUSED
            del self._assigned[shard]
            self._holders.pop(shard, None)
            if batch.step - batch.policy_version > self.max_staleness:
                self._queue.append(shard)
                self.counts.dropped_stale_rows += len(rows)
                self._condition.notify_all()
                return Delivery.STALE
            self._delivered.setdefault(batch.step, {})[shard] = batch
            self.counts.accepted_rows += len(rows)
            self._condition.notify_all()
            return Delivery.ACCEPTED

    # ---- the learner ---------------------------------------------------------------------

    def holders(self) -> dict[str, list[tuple[int, int, int]]]:
        """``{worker_id: [(step, row_start, row_count), ...]}`` of the shards assigned and
        not yet delivered ("" for a caller that gave no id)."""
        with self._condition:
            held: dict[str, list[tuple[int, int, int]]] = {}
            for shard in sorted(self._assigned, key=lambda s: (s.step, s.row_start)):
                worker = self._holders.get(shard, "")
                held.setdefault(worker, []).append((shard.step, shard.row_start, shard.row_count))
            return held

    def missing(self, step: int) -> list[tuple[int, int]]:
        """``(row_start, row_count)`` of the shards of ``step`` not delivered yet."""
        with self._condition:
            have = {shard.row_start for shard in self._delivered.get(step, {})}
            return [(start, count) for start, count in self.bounds if start not in have]

    def queued_rows(self) -> int:
        with self._condition:
            return sum(s.row_count for parts in self._delivered.values() for s in parts)

    def wait_step(self, step: int, timeout_s: float) -> list[RolloutBatch]:
        """Every shard of ``step``, once all are delivered. Raises ``TimeoutError`` naming
        the step and the missing rows after ``timeout_s``, or ``RuntimeError`` when closed."""
        deadline = self._clock() + timeout_s
        with self._condition:
            while True:
                if self._closed is not None:
                    raise RuntimeError(self._closed)
                parts = self._delivered.get(step, {})
                if len(parts) == len(self.bounds):
                    return [parts[shard] for shard in sorted(parts, key=lambda s: s.row_start)]
                remaining = deadline - self._clock()
                if remaining <= 0:
                    have = {shard.row_start for shard in parts}
                    missing = [(s, c) for s, c in self.bounds if s not in have]
                    raise TimeoutError(
                        f"rollout of step {step} did not arrive within {timeout_s:.0f} s: rows "
                        f"(start, count) {missing} missing from the rollout workers"
                    )
                self._condition.wait(min(remaining, 1.0))
                self._expire()
