"""The Jobs API end to end on a real local Ray head (own temp dir, loopback, free ports):
`distill submit` a tiny job, `status` until SUCCEEDED, `logs` shows its progress, the run
directory holds checkpoints and curves; `stop` a long job (STOPPED) and a resubmission
resumes it from its checkpoint; unknown ids and dead addresses are one-line errors."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import cli
from services.jobs import api
from tests.support.fakes import TINY_MODELS, TINY_PHASES, set_args
from tests.support.network import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = [*TINY_MODELS, *TINY_PHASES, "cluster.rollout.count=1"]


@pytest.fixture(scope="module")
def cluster():
    temp = Path("/tmp") / f"distill-jobs-{os.getpid()}"
    gcs, dashboard = free_port(), free_port()
    env = os.environ | {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--temp-dir={temp}",
        "--num-cpus=8",
        "--disable-usage-stats",
    ]
    head = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 180
    while True:
        try:
            api.list_jobs(address)
            break
        except api.JobsApiError:
            assert head.poll() is None, "the Ray head exited"
            assert time.monotonic() < deadline, "the Jobs API did not come up in 180 s"
            time.sleep(1)
    yield address
    # `ray start --block` does not exit on SIGTERM: give it a moment, then kill its group
    # (the head's GCS, raylet, dashboard and workers all run in it).
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 30)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        try:
            head.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    shutil.rmtree(temp, ignore_errors=True)


def submit(address, run, *overrides, job_id):
    sets = set_args(*TINY, *overrides)
    args = ["submit", str(ROOT / "deploy/configs/tiny.yaml"), "--run-dir", str(run)]
    assert cli.main([*args, "--address", address, "--job-id", job_id, *sets]) == 0
    return job_id


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_a_submitted_job_runs_to_success_with_logs_and_checkpoints(cluster, tmp_path, capsys):
    run = tmp_path / "run"
    job = submit(cluster, run, "opd.steps=3", job_id="tiny-ok")
    assert api.wait(job, cluster, timeout_s=900) == "SUCCEEDED", api.logs(job, cluster)[-3000:]
    assert cli.main(["status", job, "--address", cluster]) == 0
    assert "tiny-ok: SUCCEEDED" in capsys.readouterr().out
    assert cli.main(["logs", job, "--address", cluster]) == 0
    text = capsys.readouterr().out
    assert "finished: step 3/3" in text and "learner serving on 127.0.0.1" in text
    assert (run / "opd" / "checkpoints" / "3").is_dir()
    assert list((run / "opd" / "tensorboard").glob("events.out.tfevents.*"))
    assert cli.main(["list", "--address", cluster]) == 0
    assert "tiny-ok  SUCCEEDED" in capsys.readouterr().out


def test_a_stopped_job_resumes_from_its_checkpoint_when_resubmitted(cluster, tmp_path):
    run = tmp_path / "run"
    long = ("opd.steps=2000", "opd.checkpoint_every=2")
    first = submit(cluster, run, *long, job_id="long-1")
    checkpoint = run / "opd" / "checkpoints" / "2"
    wait_for(checkpoint.exists, 900, "the long job's step-2 checkpoint")
    assert cli.main(["stop", first, "--address", cluster]) == 0
    assert api.wait(first, cluster, timeout_s=120) == "STOPPED"
    second = submit(cluster, run, *long, job_id="long-2")
    resumed = f"resumed {run / 'opd'} at step"
    wait_for(lambda: resumed in api.logs(second, cluster), 900, "the resubmitted job to resume")
    api.stop(second, cluster)
    assert api.wait(second, cluster, timeout_s=120) == "STOPPED"


def test_unknown_jobs_and_dead_addresses_are_one_line_errors(cluster, capsys):
    assert cli.main(["status", "no-such-job", "--address", cluster]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "`JOB` must name a job" in error
    assert cli.main(["logs", "no-such-job", "--address", "http://127.0.0.1:1"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "nothing answered at http://127.0.0.1:1" in error


def test_code_too_large_for_the_upload_limit_is_refused_by_name(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * 2048)
    with pytest.raises(api.JobsApiError, match="`working_dir` must be smaller than Ray's upload"):
        api.check_upload_size([tmp_path], limit=1024)
