"""Dynamic batching with a recording fake scorer: grouping, limits, isolation, failures.

The scorer can be held inside a call, so requests pile up in the queue deterministically
(no reliance on timing): whatever is queued when it is released must form the next batch.
"""

import random
import threading

import grpc
import pytest

from services.common.status import status_of
from services.teacher.batching import BatcherStopped, DynamicBatcher, QueueFull

WAIT_S = 30  # generous bound on any single wait; never reached unless something hangs


class HeldScorer:
    """Records each call; the first call blocks until ``release()``."""

    def __init__(self, fail_on=None, refuse=None):
        self.calls = []
        self.refuse = refuse
        self.started = threading.Event()
        self._release = threading.Event()
        self.fail_on = fail_on

    def release(self):
        self._release.set()

    def __call__(self, sequences, top_k):
        self.calls.append(([list(s) for s in sequences], top_k))
        self.started.set()
        assert self._release.wait(WAIT_S)
        if self.fail_on is not None and any(list(s) == self.fail_on for s in sequences):
            raise RuntimeError("scorer broke")
        if self.refuse is not None and any(list(s) == self.refuse for s in sequences):
            raise ValueError("`sequences` must not hold the refused sequence")
        return [(tuple(s), top_k) for s in sequences]


def make(scorer, **overrides):
    options = dict(
        max_batch_sequences=8,
        max_batch_tokens=1000,
        max_delay_s=0.0,
        max_queue_requests=100,
        bucket_rows=False,
    )
    return DynamicBatcher(scorer, **(options | overrides))


def hold_worker(batcher, scorer):
    """Submit a first request and wait until the worker is inside its scoring call."""
    future = batcher.submit([[9, 9]], None)
    assert scorer.started.wait(WAIT_S)
    return future


def test_queued_requests_share_one_call_and_each_gets_its_own_results_in_order():
    scorer = HeldScorer()
    batcher = make(scorer)
    first = hold_worker(batcher, scorer)
    a = batcher.submit([[1, 2], [3, 4, 5]], None)
    b = batcher.submit([[6, 7]], 3)  # another top_k: never in the same call
    c = batcher.submit([[8, 9, 10], [11, 12]], None)
    scorer.release()
    assert first.result(WAIT_S) == [((9, 9), None)]
    assert a.result(WAIT_S) == [((1, 2), None), ((3, 4, 5), None)]
    assert b.result(WAIT_S) == [((6, 7), 3)]
    assert c.result(WAIT_S) == [((8, 9, 10), None), ((11, 12), None)]
    assert [call for call in scorer.calls[1:]] == [
        ([[1, 2], [3, 4, 5], [8, 9, 10], [11, 12]], None),
        ([[6, 7]], 3),
    ]
    stats = batcher.stats()
    assert (stats.requests, stats.batches, stats.largest_batch_requests) == (4, 3, 2)
    batcher.stop()


def test_a_request_larger_than_a_batch_is_split_and_reassembled_in_order():
    scorer = HeldScorer()
    scorer.release()
    batcher = make(scorer, max_batch_sequences=4)
    sequences = [[i, i + 1] for i in range(10)]
    assert batcher.submit(sequences, None).result(WAIT_S) == [(tuple(s), None) for s in sequences]
    assert [len(call[0]) for call in scorer.calls] == [4, 4, 2]
    batcher.stop()


def test_rows_are_bucketed_to_powers_of_two_with_filler_rows_whose_results_are_dropped():
    scorer = HeldScorer()
    scorer.release()
    batcher = make(scorer, bucket_rows=True, filler=(0, 0), max_batch_sequences=6)
    assert len(batcher.submit([[1, 2], [3, 4], [5, 6]], None).result(WAIT_S)) == 3
    assert scorer.calls[-1][0] == [[1, 2], [3, 4], [5, 6], [0, 0]]
    # Above the largest power of two that fits, the bucket is max_batch_sequences itself.
    assert len(batcher.submit([[1, 2]] * 5, None).result(WAIT_S)) == 5
    assert len(scorer.calls[-1][0]) == 6
    assert batcher.stats().rows == 10
    batcher.stop()


def test_padded_tokens_per_call_stay_within_max_batch_tokens_except_a_lone_long_sequence():
    scorer = HeldScorer()
    scorer.release()
    batcher = make(scorer, max_batch_tokens=20)
    out = batcher.submit([[1] * 10, [2] * 10, [3] * 10, [4] * 30, [5] * 2], None).result(WAIT_S)
    assert [len(seq) for seq, _ in out] == [10, 10, 10, 30, 2]
    assert [[len(s) for s in call[0]] for call in scorer.calls] == [[10, 10], [10], [30], [2]]
    batcher.stop()


def test_a_full_queue_refuses_new_requests_and_accepts_again_once_drained():
    scorer = HeldScorer()
    batcher = make(scorer, max_queue_requests=1)
    first = hold_worker(batcher, scorer)
    waiting = batcher.submit([[1, 2]], None)
    with pytest.raises(QueueFull, match=r"^`queue` must have room .*max_queue_requests=1"):
        batcher.submit([[3, 4]], None)
    scorer.release()
    first.result(WAIT_S), waiting.result(WAIT_S)
    assert batcher.submit([[3, 4]], None).result(WAIT_S) == [((3, 4), None)]
    batcher.stop()


def test_a_failing_call_fails_its_requests_only_and_the_worker_keeps_serving():
    scorer = HeldScorer(fail_on=[6, 6])
    batcher = make(scorer, max_batch_sequences=2)
    first = hold_worker(batcher, scorer)
    # Split across calls (max 2 rows): the failure in the second call fails the whole request.
    bad = batcher.submit([[5, 5], [6, 6], [7, 7]], 1)
    good = batcher.submit([[8, 8]], None)
    scorer.release()
    first.result(WAIT_S)
    with pytest.raises(RuntimeError, match="scorer broke"):
        bad.result(WAIT_S)
    assert good.result(WAIT_S) == [((8, 8), None)]
    assert batcher.submit([[1, 2]], 1).result(WAIT_S) == [((1, 2), 1)]
    batcher.stop()


def test_a_sequence_the_teacher_refuses_fails_only_the_request_that_sent_it():
    scorer = HeldScorer(refuse=[6, 6])
    batcher = make(scorer)
    first = hold_worker(batcher, scorer)
    bad = batcher.submit([[5, 5], [6, 6]], None)
    good = batcher.submit([[8, 8], [7, 7]], None)
    scorer.release()
    first.result(WAIT_S)
    with pytest.raises(ValueError, match="refused sequence"):
        bad.result(WAIT_S)
    # Shared a call with the refused sequence, then was scored again on its own.
    assert good.result(WAIT_S) == [((8, 8), None), ((7, 7), None)]
    assert [call for call, _ in scorer.calls[1:]] == [
        [[5, 5], [6, 6], [8, 8], [7, 7]],
        [[5, 5], [6, 6]],
        [[8, 8], [7, 7]],
    ]
    batcher.stop()


def test_cancelled_requests_are_never_scored():
    scorer = HeldScorer()
    batcher = make(scorer)
    first = hold_worker(batcher, scorer)
    gone = batcher.submit([[4, 4]], None)
    assert gone.cancel()
    kept = batcher.submit([[5, 5]], None)
    scorer.release()
    first.result(WAIT_S)
    assert kept.result(WAIT_S) == [((5, 5), None)]
    assert all([4, 4] not in call[0] for call in scorer.calls)
    batcher.stop()


def test_stop_scores_what_is_queued_without_waiting_for_company_then_refuses():
    scorer = HeldScorer()
    scorer.release()
    batcher = make(scorer, max_delay_s=3600.0)  # would wait an hour for company
    queued = batcher.submit([[1, 2]], None)
    batcher.stop(timeout_s=WAIT_S)
    assert queued.result(0) == [((1, 2), None)]
    with pytest.raises(BatcherStopped, match="^`batcher` must be running"):
        batcher.submit([[1, 2]], None)


def test_many_concurrent_callers_never_get_each_others_results():
    def echo(sequences, top_k):
        return [(tuple(s), top_k) for s in sequences]

    batcher = make(
        echo, max_batch_sequences=8, max_batch_tokens=64, max_delay_s=0.001, bucket_rows=True
    )
    errors = []

    def caller(seed):
        rng = random.Random(seed)
        for _ in range(40):
            sequences = [
                [rng.randrange(100) for _ in range(rng.randrange(2, 12))]
                for _ in range(rng.randrange(1, 12))
            ]
            top_k = rng.choice([None, 1, 5])
            got = batcher.submit(sequences, top_k).result(WAIT_S)
            if got != [(tuple(s), top_k) for s in sequences]:
                errors.append((seed, sequences, got))

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors
    assert batcher.stats().requests == 16 * 40
    batcher.stop()


def test_a_full_queue_and_a_stopped_batcher_are_unavailable_to_callers():
    # Both are transient: servicers answer UNAVAILABLE, which clients retry with backoff.
    assert status_of(QueueFull("`queue` must have room")) == grpc.StatusCode.UNAVAILABLE
    assert status_of(BatcherStopped("stopping")) == grpc.StatusCode.UNAVAILABLE
    assert issubclass(QueueFull, RuntimeError) and issubclass(BatcherStopped, RuntimeError)
