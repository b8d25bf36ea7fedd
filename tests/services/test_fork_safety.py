"""A process that imports ``services`` and then serves gRPC can start child processes the
way Ray starts its GCS and raylet (``Popen`` with a ``preexec_fn``): with gRPC's fork support
on, grpcio 1.81+ aborted about one such child in six before its ``exec``
(services/__init__.py), which lost an embedded Ray's GCS.

Run in a fresh interpreter: the setting only counts before gRPC is first imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from services import GRPC_FORK_SUPPORT_VARIABLE

FORKS = 150

CHILD = textwrap.dedent(
    f"""
    import services  # first, as every entry point does
    import subprocess, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    done = threading.Event()

    def call_the_server():
        with grpc.insecure_channel(f"127.0.0.1:{{port}}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(5000):
                if done.is_set():
                    return
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    caller = threading.Thread(target=call_the_server, daemon=True)
    caller.start()
    codes = []
    for _ in range({FORKS}):
        child = subprocess.Popen(["true"], preexec_fn=lambda: None, stderr=subprocess.DEVNULL)
        try:
            codes.append(child.wait(timeout=20))
        except subprocess.TimeoutExpired:  # stuck between fork and exec
            child.kill()
            codes.append("hung")
    done.set()
    caller.join(timeout=30)
    server.stop(0)
    print(sorted(set(map(str, codes))))
    """
)


def test_children_started_with_a_preexec_fn_beside_live_grpc_all_exec():
    env = {key: value for key, value in os.environ.items() if key != GRPC_FORK_SUPPORT_VARIABLE}
    try:
        result = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as stuck:  # what fork support on did to the parent
        raise AssertionError(f"{FORKS} forks beside live gRPC did not finish in 120 s") from stuck
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['0']", (result.stdout, result.stderr[-2000:])
