"""A bounded soak of the teacher server: 64 concurrent clients for ``SOAK_S`` seconds against a
server in its own process whose queue is kept small, so back-pressure happens.

What it pins: zero errors reach the clients (a full queue answers ``UNAVAILABLE``, which
``RemoteTeacher`` retries with backoff inside its budget); every answer equals the scores the
same teacher gives in process; the queue never holds more than ``max_queue_requests``
(the server refuses beyond it instead of growing); the p99 call latency and the server's
memory growth stay within stated, generous bounds. Bounded in time and count; loopback only.
"""

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from services.teacher.client import RemoteTeacher
from tests.services.teacher.test_endpoint_hardening import rss_bytes, script_server, tiny_teacher

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SOAK_S = float(os.environ.get("DISTILL_SOAK_S", "60"))
CLIENTS = 64
QUEUE = 8
#: Stated bounds (generous: two shared cores run the server, 64 client threads and XLA).
P99_BOUND_S = 20.0
RSS_GROWTH_BOUND = 64 << 20
WAIT_S = 120

SERVE_SCRIPT = f"""
import sys, threading
from tests.services.teacher.test_endpoint_hardening import tiny_teacher
from services.teacher.server import TeacherServerConfig, serve_teacher
config = TeacherServerConfig(max_queue_requests={QUEUE}, max_batch_sequences=8)
server = serve_teacher(tiny_teacher(), config)
print(server.address, flush=True)
def report():
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        stats = server.stats()
        print(f"stats {{stats.requests}} {{stats.queued}}", flush=True)
report()
server.stop()
"""


def test_64_clients_for_a_minute_see_no_error_and_the_queue_stays_bounded():
    reference = tiny_teacher()
    rng = np.random.default_rng(0)
    vocab = reference.info().vocab_size
    workload = [rng.integers(4, vocab, rng.integers(2, 17)).tolist() for _ in range(32)]
    expected = [scored.log_probs for scored in reference.score(workload)]
    latencies: list[float] = []
    errors: list[BaseException] = []
    mismatches = []
    lock = threading.Lock()
    with script_server(SERVE_SCRIPT) as (process, lines, address):
        with RemoteTeacher(address, timeout_s=WAIT_S, budget_s=60.0) as warm:
            warm.score(workload[:1])  # compiles before the clock starts
        before = rss_bytes(process.pid)
        deadline = time.monotonic() + SOAK_S

        def client(index: int) -> None:
            local = np.random.default_rng(index)
            with RemoteTeacher(address, timeout_s=WAIT_S, budget_s=60.0) as remote:
                while time.monotonic() < deadline:
                    pick = local.integers(0, len(workload), local.integers(1, 4))
                    started = time.monotonic()
                    try:
                        got = remote.score([workload[i] for i in pick])
                    except Exception as error:  # counted, asserted below
                        with lock:
                            errors.append(error)
                        return
                    with lock:
                        latencies.append(time.monotonic() - started)
                        for i, scored in zip(pick, got, strict=True):
                            if not np.allclose(scored.log_probs, expected[i], atol=1e-5):
                                mismatches.append(int(i))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        queued_peak = 0
        while any(thread.is_alive() for thread in threads):
            process.stdin.write("\n")
            process.stdin.flush()
            line = lines.get(timeout=WAIT_S)
            queued_peak = max(queued_peak, int(line.split()[2]))
            time.sleep(0.5)
        for thread in threads:
            thread.join(WAIT_S)
        grown = rss_bytes(process.pid) - before
    assert not errors, f"{len(errors)} errors, first: {errors[0]!r}"
    assert not mismatches
    assert latencies, "no call finished"
    p99 = float(np.percentile(latencies, 99))
    assert queued_peak <= QUEUE
    assert p99 < P99_BOUND_S, f"p99 {p99:.2f} s over {len(latencies)} calls"
    assert grown < RSS_GROWTH_BOUND, f"server grew {grown / 2**20:.1f} MiB"
    print(
        f"soak: {len(latencies)} calls in {SOAK_S:.0f} s from {CLIENTS} clients, p99 "
        f"{p99 * 1000:.0f} ms, queue peak {queued_peak}/{QUEUE}, server RSS "
        f"{grown / 2**20:+.1f} MiB"
    )
