"""A bounded soak of a running job's services together: 64 outside clients score on the
job's teacher replica while the job's own learner scores, trains and publishes through it.

What it pins: no outside call fails (back-pressure is answered ``UNAVAILABLE`` and retried by
``RemoteTeacher`` inside its budget), every answer for the same ids is the same, the job
finishes with every sample trained exactly once, and the replica's memory growth and the
outside calls' p99 latency stay within stated, generous bounds (printed with the call count).
The clients stop at ``SOAK_S`` seconds or when the job nears its last step, whichever comes
first (so they never score against a replica being torn down); the overlap is printed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from services.teacher.client import RemoteTeacher
from tests.services.teacher.test_endpoint_hardening import rss_bytes
from tests.support.running_job import (
    RunningJob,
    fresh_run,
    job_with,
    rows_per_step,
)

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("DISTILL_SOAK_S", "60"))
CLIENTS = 64
STEPS = 24
#: Stated bounds (generous: two shared cores run Ray, the job's actors and 64 client threads).
P99_BOUND_S = 30.0
RSS_GROWTH_BOUND = 128 << 20
WAIT_S = 240.0


def _ledger(run: Path) -> list[list[int]]:
    steps = [int(p.name) for p in (run / "opd" / "checkpoints").iterdir() if p.name.isdigit()]
    metadata = run / "opd" / "checkpoints" / str(max(steps)) / "progress" / "metadata"
    progress = json.loads(metadata.read_text())
    assert progress["policy_version"] == max(steps) == STEPS
    return progress["ledger"]


def test_64_clients_on_a_running_jobs_teacher_see_no_error_and_the_job_trains_each_sample_once(
    phases,  # noqa: F811  (the imported fixture)
    ray_session,  # noqa: F811
    tmp_path,
):
    job = job_with(f"opd.steps={STEPS}", "opd.checkpoint_every=8")
    running = RunningJob(job, fresh_run(phases, tmp_path / "run"))
    running.wait_status(lambda s: s["step"] >= 1, "step 1 to train")
    # Serving by now (the job started it), so start() answers its advertised address.
    address = running.call("teacher-0", "start", "the teacher replica's address")
    pid = running.call("teacher-0", "pid", "the teacher replica's pid")

    with RemoteTeacher(address, timeout_s=WAIT_S, budget_s=WAIT_S) as probe:
        vocab = probe.info().vocab_size
    rng = np.random.default_rng(0)
    workload = [rng.integers(4, vocab, rng.integers(2, 17)).tolist() for _ in range(32)]
    first_answer: dict[int, np.ndarray] = {}
    latencies: list[float] = []
    errors: list[BaseException] = []
    mismatches: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    before = rss_bytes(pid)
    started = time.monotonic()

    def client(index: int) -> None:
        local = np.random.default_rng(index)
        with RemoteTeacher(address, timeout_s=WAIT_S, budget_s=60.0) as remote:
            while not stop.is_set():
                pick = local.integers(0, len(workload), local.integers(1, 4))
                began = time.monotonic()
                try:
                    got = remote.score([workload[i] for i in pick])
                except Exception as error:  # counted, asserted below
                    with lock:
                        errors.append(error)
                    return
                with lock:
                    latencies.append(time.monotonic() - began)
                    for i, scored in zip(pick, got, strict=True):
                        seen = first_answer.setdefault(int(i), np.asarray(scored.log_probs))
                        if not np.allclose(scored.log_probs, seen, atol=1e-5):
                            mismatches.append(int(i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        # Until the soak time is up or the job is two steps from its end.
        running.wait_status(
            lambda s: s["step"] >= STEPS - 2 or time.monotonic() - started >= SOAK_S,
            "the soak to end",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    overlap = time.monotonic() - started
    grown = rss_bytes(pid) - before
    result, error = running.finish()

    assert error is None, error
    assert result.status["step"] == STEPS and result.status["error"] == ""
    assert result.status["accepted_rows"] == STEPS * rows_per_step(job)  # none twice
    assert _ledger(running.run) == [[0, STEPS * job.data.batch_size]]
    assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
    assert not mismatches
    assert latencies, "no outside call finished"
    p99 = float(np.percentile(latencies, 99))
    assert p99 < P99_BOUND_S, f"p99 {p99:.2f} s over {len(latencies)} calls"
    assert grown < RSS_GROWTH_BOUND, f"the replica grew {grown / 2**20:.1f} MiB"
    print(
        f"job soak: {len(latencies)} outside calls from {CLIENTS} clients over {overlap:.0f} s "
        f"of a running job ({STEPS} steps), p99 {p99 * 1000:.0f} ms, replica RSS "
        f"{grown / 2**20:+.1f} MiB, 0 errors"
    )
