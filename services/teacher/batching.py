"""Dynamic batching: many concurrent requests, one scoring call per batch.

Callers :meth:`DynamicBatcher.submit` a request (some items, e.g. sequences, and a hashable
``key`` saying how to score them, e.g. a ``top_k``) and get a future. One worker thread forms
batches: it takes the oldest queued request, waits at most ``max_delay_s`` from that
request's arrival for more work with the same ``key`` (leaving earlier once a batch is full),
then packs queued items with that ``key`` in arrival order into one ``score(items, key)``
call, and hands each request back exactly its own results, in its own order. An item's
padded width is ``length(item)`` (``len`` by default).

Contracts:

* A batch holds at most ``max_batch_sequences`` rows and ``rows x longest sequence`` <=
  ``max_batch_tokens`` (the padded size of the call), rows counted after bucketing; a single
  sequence longer than that goes alone. A request larger than a batch is split across
  consecutive batches; its future resolves when all of its sequences are scored.
* Requests with different keys never share a batch (the call has one key).
* ``bucket_rows``: the row count is padded up to a power of two (capped at
  ``max_batch_sequences``) with ``filler`` rows (an item, or ``filler(key)`` when callable)
  whose results are dropped, so a jitted scorer compiles once per bucket instead of once per
  row count.
* At most ``max_queue_requests`` requests wait (not yet fully in a batch); ``submit`` raises
  :class:`QueueFull` beyond that, so overload is refused early instead of growing latency.
* A cancelled future's sequences that are not yet in a batch are dropped. A failing
  ``score`` call fails every request with a sequence in that batch; the worker keeps going.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Generic, TypeVar

from services.common.status import Unavailable

Result = TypeVar("Result")


class QueueFull(Unavailable):
    """The batcher already holds ``max_queue_requests`` waiting requests (transient: a
    servicer answers ``UNAVAILABLE``, see :mod:`services.common.status`)."""


class BatcherStopped(Unavailable):
    """The batcher was stopped before the request was scored (``UNAVAILABLE``)."""


@dataclasses.dataclass(eq=False)
class _Request:
    sequences: Sequence[Any]
    top_k: Hashable
    arrival: float
    future: Future
    results: list
    taken: int = 0  # sequences handed to batches so far
    scored: int = 0  # sequences whose results came back


@dataclasses.dataclass(frozen=True)
class BatcherStats:
    """Counters since start: ``requests`` submitted, ``batches`` scored, ``sequences`` scored
    (real rows), ``rows`` (including filler rows), ``largest_batch_requests`` (most distinct
    requests that shared one batch), ``queued`` (requests waiting now)."""

    requests: int
    batches: int
    sequences: int
    rows: int
    largest_batch_requests: int
    queued: int = 0


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


class DynamicBatcher(Generic[Result]):
    """Groups concurrent requests into batched ``score(sequences, top_k)`` calls (see the
    module docstring). ``score`` must return one result per sequence, in order."""

    def __init__(
        self,
        score: Callable[[list[Any], Hashable], list[Result]],
        *,
        max_batch_sequences: int,
        max_batch_tokens: int,
        max_delay_s: float,
        max_queue_requests: int,
        bucket_rows: bool = True,
        filler: Any = (0, 0),
        length: Callable[[Any], int] = len,
        name: str = "batcher",
        on_batch: Callable[[int, int, Sequence[Any]], None] | None = None,
    ):
        self._score = score
        self.max_batch_sequences = max_batch_sequences
        self.max_batch_tokens = max_batch_tokens
        self.max_delay_s = max_delay_s
        self.max_queue_requests = max_queue_requests
        self.bucket_rows = bucket_rows
        self._filler = filler
        self._length = length
        self._on_batch = on_batch
        self._queue: collections.deque[_Request] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._counts = dict(requests=0, batches=0, sequences=0, rows=0, largest_batch_requests=0)
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    # ---- callers ---------------------------------------------------------------------------

    def submit(self, sequences: Sequence[Any], top_k: Hashable) -> Future:
        """Queue a request of items scored with key ``top_k``; the future resolves to its
        results (one per item, in order).
        Raises :class:`QueueFull` when ``max_queue_requests`` requests already wait."""
        if not sequences:
            raise ValueError("`sequences` must hold at least one sequence; received 0")
        future: Future = Future()
        request = _Request(sequences, top_k, time.monotonic(), future, [None] * len(sequences))
        with self._cond:
            if self._stopping:
                raise BatcherStopped("`batcher` must be running to take requests; it is stopping")
            if len(self._queue) >= self.max_queue_requests:
                raise QueueFull(
                    f"`queue` must have room for the request (max_queue_requests="
                    f"{self.max_queue_requests}); received one while "
                    f"{len(self._queue)} requests wait; retry later"
                )
            self._queue.append(request)
            self._counts["requests"] += 1
            self._cond.notify()
        return future

    def stats(self) -> BatcherStats:
        with self._cond:
            return BatcherStats(**self._counts, queued=len(self._queue))

    def stop(self, timeout_s: float | None = None) -> None:
        """Score what is already queued (no more waiting for company), then end the worker;
        later submissions raise :class:`BatcherStopped`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._worker.join(timeout_s)

    # ---- worker ----------------------------------------------------------------------------

    def _rows(self, n: int) -> int:
        if not self.bucket_rows:
            return n
        return min(_pow2_at_least(n), max(self.max_batch_sequences, n))

    def _fits(self, rows: int, width: int) -> bool:
        return (
            rows <= self.max_batch_sequences and self._rows(rows) * width <= self.max_batch_tokens
        )

    def _plan(self, top_k: Hashable) -> tuple[list[tuple[_Request, int]], bool]:
        """The (request, index) rows the next batch with ``top_k`` would take, in arrival
        order, and whether a limit stopped it (the batch is full). Caller holds the lock."""
        rows: list[tuple[_Request, int]] = []
        width = 0
        for request in self._queue:
            if request.top_k != top_k or request.future.cancelled():
                continue
            for index in range(request.taken, len(request.sequences)):
                length = self._length(request.sequences[index])
                new_width = max(width, length)
                if rows and not self._fits(len(rows) + 1, new_width):
                    return rows, True
                rows.append((request, index))
                width = new_width
        return rows, len(rows) >= self.max_batch_sequences

    def _next_batch(self) -> tuple[list[tuple[_Request, int]], Hashable] | None:
        """Wait for work and take one batch from the queue; None when stopping and empty."""
        with self._cond:
            while True:
                # Cancelled requests are forgotten; their callers have gone.
                while self._queue and self._queue[0].future.cancelled():
                    self._queue.popleft()
                if not self._queue:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                head = self._queue[0]
                rows, full = self._plan(head.top_k)
                remaining = head.arrival + self.max_delay_s - time.monotonic()
                if full or remaining <= 0 or self._stopping:
                    break
                self._cond.wait(remaining)
            for request, index in rows:
                request.taken = index + 1
            self._queue = collections.deque(
                r for r in self._queue if r.taken < len(r.sequences) and not r.future.cancelled()
            )
            return rows, head.top_k

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            rows, top_k = batch
            if rows:
                self._score_batch(rows, top_k)

    def _score_batch(self, rows: list[tuple[_Request, int]], top_k: Hashable) -> None:
        sequences = [request.sequences[index] for request, index in rows]
        padded = self._rows(len(sequences))
        filler = self._filler(top_k) if callable(self._filler) else list(self._filler)
        sequences += [filler] * (padded - len(sequences))
        try:
            results = self._score(sequences, top_k)
            if len(results) != len(sequences):
                raise RuntimeError(
                    f"`score` must return one result per sequence ({len(sequences)}); "
                    f"received {len(results)}"
                )
        except ValueError as error:
            owners = list(dict.fromkeys(request for request, _ in rows))
            if len(owners) == 1:
                self._fail_batch(rows, padded, error)
                return
            # The teacher refused a sequence: score each caller's rows alone so only the
            # caller who sent it hears the refusal (with its own request's indices).
            for owner in owners:
                self._score_batch([(r, i) for r, i in rows if r is owner], top_k)
            return
        except Exception as error:  # every caller in the batch hears about it
            self._fail_batch(rows, padded, error)
            return
        self._count_batch(rows, padded, failed=False)
        if self._on_batch is not None:
            self._on_batch(len(rows), padded, sequences[: len(rows)])
        for (request, index), result in zip(rows, results, strict=False):
            request.results[index] = result
            request.scored += 1
            if request.scored == len(request.sequences):
                _settle(request.future, result=request.results)

    def _fail_batch(self, rows, padded: int, error: BaseException) -> None:
        for request in {request for request, _ in rows}:
            _settle(request.future, error=error)
        self._count_batch(rows, padded, failed=True)

    def _count_batch(self, rows, padded: int, failed: bool) -> None:
        with self._cond:
            self._counts["batches"] += 1
            self._counts["sequences"] += len(rows)
            self._counts["rows"] += padded
            self._counts["largest_batch_requests"] = max(
                self._counts["largest_batch_requests"], len({id(r) for r, _ in rows})
            )
            if failed:
                # The rest of a split request can no longer complete.
                self._queue = collections.deque(r for r in self._queue if not r.future.done())


def _settle(future: Future, *, result: object = None, error: BaseException | None = None) -> None:
    # A caller may cancel at any moment; a settled or cancelled future is left as it is.
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
