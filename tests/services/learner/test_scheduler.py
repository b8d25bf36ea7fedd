"""The learner's work scheduler: deterministic rollout versions, staleness drops, refused
duplicates, reassignment of a dead worker's shard, and waits that name what they wait for."""

import time
import types

import numpy as np
import pytest

from services.learner.scheduler import Delivery, WorkKind, WorkScheduler, shard_bounds


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def scheduler(staleness=0, shards=2, rows=4, start=0, end=3, clock=None, reassign=60.0):
    return WorkScheduler(
        start_step=start,
        end_step=end,
        rows_per_step=rows,
        shards_per_step=shards,
        max_staleness=staleness,
        stream_positions=lambda step: [step * rows + row for row in range(rows)],
        reassign_after_s=reassign,
        clock=clock or Clock(),
    )


def batch(assignment, version=None):
    shard = assignment.shard
    return types.SimpleNamespace(
        step=shard.step,
        policy_version=assignment.policy_version if version is None else version,
        row_ids=np.arange(shard.row_start, shard.row_start + shard.row_count),
        rows=shard.row_count,
    )


def test_shards_cover_the_rows_contiguously():
    assert shard_bounds(5, 2) == [(0, 3), (3, 2)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 1)]


def test_on_policy_hands_out_a_step_only_after_the_previous_one_trained():
    work = scheduler(staleness=0)
    first, second = work.acquire(), work.acquire()
    assert (first.shard.step, second.shard.step) == (0, 0)
    assert first.policy_version == second.policy_version == 0
    assert work.acquire().kind is WorkKind.WAIT
    work.publish(1)
    assert work.acquire().shard.step == 1


def test_one_version_of_staleness_overlaps_the_next_rollout_with_the_update():
    work = scheduler(staleness=1)
    assignments = [work.acquire() for _ in range(4)]
    assert [(a.shard.step, a.policy_version) for a in assignments] == [
        (0, 0),
        (0, 0),
        (1, 0),
        (1, 0),
    ]
    assert work.acquire().kind is WorkKind.WAIT
    work.publish(1)
    assert (work.acquire().shard.step, work.rollout_version(2)) == (2, 1)


def test_a_resumed_run_rolls_out_its_first_steps_with_the_restored_version():
    work = scheduler(staleness=1, start=5, end=9)
    assert work.rollout_version(5) == work.rollout_version(6) == 5
    assert work.rollout_version(7) == 6


def test_a_trace_beyond_max_staleness_is_dropped_counted_and_handed_out_again():
    work = scheduler(staleness=1, shards=1)
    first = work.acquire()
    work.publish(2)  # pretend two updates happened while the shard was out
    stale = types.SimpleNamespace(**{**vars(batch(first)), "step": 2})
    work._assigned[type(first.shard)(2, 0, 4)] = 0.0  # the same rows, now of step 2
    assert work.deliver(stale) is Delivery.STALE
    assert work.counts.dropped_stale_rows == 4
    again = work.acquire()
    assert (again.shard.step, again.policy_version) == (2, 1)
    assert work.deliver(batch(again)) is Delivery.ACCEPTED


def test_a_second_delivery_of_the_same_shard_is_refused():
    work = scheduler(shards=1)
    assignment = work.acquire()
    assert work.deliver(batch(assignment)) is Delivery.ACCEPTED
    assert work.deliver(batch(assignment)) is Delivery.REFUSED
    assert work.counts.refused_rows == 4
    assert [part.step for part in work.wait_step(0, timeout_s=1)] == [0]


def test_a_shard_whose_worker_went_silent_is_reassigned_and_trained_once():
    clock = Clock()
    work = scheduler(shards=1, clock=clock, reassign=10.0)
    lost = work.acquire()
    clock.now = 11.0
    again = work.acquire()
    assert again.shard == lost.shard and work.counts.reassigned_shards == 1
    assert work.deliver(batch(again)) is Delivery.ACCEPTED
    assert work.deliver(batch(lost)) is Delivery.REFUSED


def test_waiting_for_a_step_names_the_missing_rows():
    work = scheduler(shards=2, clock=time.monotonic)
    assignment = work.acquire()
    work.deliver(batch(assignment))
    with pytest.raises(TimeoutError, match=r"step 0 .*\[\(2, 2\)\] missing"):
        work.wait_step(0, timeout_s=0.05)


def test_closing_ends_the_work_and_wakes_the_learner():
    work = scheduler()
    work.close("learner stopped: boom")
    assert work.acquire().kind is WorkKind.DONE
    with pytest.raises(RuntimeError, match="boom"):
        work.wait_step(0, timeout_s=5)
