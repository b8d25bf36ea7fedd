"""The Jobs API verbs: submit a job to a Ray cluster, follow it, stop it, list jobs.

A thin layer over Ray's :class:`~ray.job_submission.JobSubmissionClient` (the Ray Jobs API
served by the cluster's dashboard, ``http://HOST:8265``), so a distillation job is an
ordinary Ray job: ``ray job status/logs/stop`` work on it too.

What is submitted: the job's config, validated here with every ``--set`` applied, written
to a small working directory (``job.yaml``) that Ray uploads, and the entrypoint
``python -m services.cli run job.yaml --run-dir RUN``. From a source checkout the
``distill`` and ``services`` packages travel with it (``py_modules``), so the cluster runs
the submitted code; from an installed package the cluster's own install is used. The
cluster must have the dependencies (the same ``pyproject.toml``) installed. The run
directory is a path on the cluster (shared storage on a multi-host cluster).

Every failure is a :class:`JobsApiError` with one line: an unreachable address, an unknown
job id, or code too large for Ray's upload limit.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from services.common.config import JobSpec

#: The Jobs API address when neither ``--address`` nor ``RAY_ADDRESS`` is given.
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_PACKAGES = ("distill", "services")
# Ray refuses a package at its gRPC message limit (512 MiB by default; see
# ray/_private/runtime_env/packaging.py); checked here first to say what to exclude.
_UPLOAD_LIMIT_BYTES = int(os.environ.get("RAY_max_grpc_message_size", 512 << 20))  # noqa: SIM112
_EXCLUDES = ("__pycache__", "*.pyc")


class JobsApiError(RuntimeError):
    """A Jobs API call failed; the message is one line for the user."""


def resolve_address(address: str | None) -> str:
    """``address``, else ``RAY_ADDRESS`` (when it is an http(s) Jobs API address), else the
    local default."""
    address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    if not address.startswith(("http://", "https://")):
        raise JobsApiError(
            f"`--address` must be the cluster's Jobs API (http://HOST:8265); received {address!r}"
        )
    return address


def ray_token() -> str | None:
    """The cluster token Ray's token authentication expects (Ray's own sources, in its
    order: ``RAY_AUTH_TOKEN``, the file at ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``);
    None when there is none (a cluster without token authentication)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def connect(address: str | None):
    """A :class:`JobSubmissionClient`, or :class:`JobsApiError` when nothing answers. The
    cluster's token (:func:`ray_token`) is sent as a bearer header when there is one."""
    from ray.job_submission import JobSubmissionClient

    resolved = resolve_address(address)
    token = ray_token()
    headers = {"authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(resolved, headers=headers)
    except Exception as error:  # noqa: BLE001 - Ray raises ConnectionError/RuntimeError
        raise JobsApiError(
            f"`--address` must reach a Ray cluster's Jobs API; nothing answered at {resolved} "
            f"({type(error).__name__})"
        ) from None


def source_packages() -> list[Path] | None:
    """The ``distill`` and ``services`` package directories when running from a source
    checkout (a ``pyproject.toml`` beside them), else None (an installed package)."""
    import services

    root = Path(services.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        return None
    return [root / name for name in _PACKAGES]


def _size(path: Path) -> int:
    return sum(
        file.stat().st_size
        for file in path.rglob("*")
        if file.is_file() and "__pycache__" not in file.parts
    )


def check_upload_size(paths: Sequence[Path], limit: int = _UPLOAD_LIMIT_BYTES) -> None:
    """Refuse (naming the largest path) code that Ray would refuse to upload."""
    sizes = {path: _size(path) for path in paths}
    total = sum(sizes.values())
    if total >= limit:
        largest = max(sizes, key=sizes.get)
        raise JobsApiError(
            f"`working_dir` must be smaller than Ray's upload limit {limit >> 20} MiB; "
            f"received {total >> 20} MiB (largest: {largest}, {sizes[largest] >> 20} MiB); "
            "move data out of the package directories"
        )


@dataclasses.dataclass(frozen=True)
class Submission:
    job_id: str
    address: str
    entrypoint: str
    runtime_env: dict[str, Any]


def submit(
    job: JobSpec,
    run_dir: str,
    *,
    address: str | None = None,
    job_id: str | None = None,
    workdir: str | Path | None = None,
) -> Submission:
    """Submit ``job`` (validated) to run in ``run_dir`` on the cluster; returns its id."""
    client = connect(address)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="distill-submit-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    runtime_env: dict[str, Any] = {
        "working_dir": str(workdir),
        "env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"},
        "excludes": list(_EXCLUDES),
    }
    packages = source_packages()
    if packages is not None:
        check_upload_size([workdir, *packages])
        runtime_env["py_modules"] = [str(path) for path in packages]
    entrypoint = shlex.join(
        ["python", "-m", "services.cli", "run", "job.yaml", "--run-dir", run_dir, "--quiet"]
    )
    try:
        submitted = client.submit_job(
            entrypoint=entrypoint,
            runtime_env=runtime_env,
            submission_id=job_id,
            metadata={"distill": "run", "run_dir": run_dir},
        )
    except Exception as error:  # noqa: BLE001 - Ray's HTTP errors, one line for the user
        raise JobsApiError(
            f"submission refused by {client.get_address()}: {_first_line(error)}"
        ) from None
    return Submission(submitted, client.get_address(), entrypoint, runtime_env)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _call(address: str | None, job_id: str, action: Callable[[Any], Any]) -> Any:
    client = connect(address)
    try:
        return action(client)
    except Exception as error:  # noqa: BLE001
        message = str(error)
        if "does not exist" in message or "not found" in message.lower():
            raise JobsApiError(
                f"`JOB` must name a job of {client.get_address()}; received {job_id!r} "
                "(see `distill list`)"
            ) from None
        raise JobsApiError(f"{job_id}: {_first_line(error)}") from None


def status(job_id: str, address: str | None = None) -> dict[str, Any]:
    """``{"job_id", "status", "message", "entrypoint", "metadata"}``."""

    def info(client):
        details = client.get_job_info(job_id)
        return {
            "job_id": job_id,
            "status": str(details.status.value),
            "message": details.message or "",
            "entrypoint": details.entrypoint,
            "metadata": dict(details.metadata or {}),
        }

    return _call(address, job_id, info)


def wait(job_id: str, address: str | None = None, *, timeout_s: float, poll_s: float = 1.0) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED (its status), or
    :class:`JobsApiError` after ``timeout_s`` naming the job and its last status."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(job_id, address)["status"]
        if current in TERMINAL:
            return current
        if time.monotonic() > deadline:
            raise JobsApiError(
                f"job {job_id} did not finish within {timeout_s:.0f} s (last status {current})"
            )
        time.sleep(poll_s)


def logs(job_id: str, address: str | None = None) -> str:
    return _call(address, job_id, lambda client: client.get_job_logs(job_id))


def follow(job_id: str, address: str | None = None) -> Iterator[str]:
    """The job's log as it grows, until the job ends."""
    import asyncio

    status(job_id, address)  # fails by name on an unknown id
    client = connect(address)
    queue: list[str] = []

    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            queue.append(chunk)

    loop = asyncio.new_event_loop()
    task = loop.create_task(tail())
    try:
        while not task.done():
            loop.run_until_complete(asyncio.wait([task], timeout=0.5))
            while queue:
                yield queue.pop(0)
        while queue:
            yield queue.pop(0)
    finally:
        task.cancel()
        loop.close()


def stop(job_id: str, address: str | None = None) -> bool:
    """Ask the cluster to stop the job; False when it had already ended."""
    return bool(_call(address, job_id, lambda client: client.stop_job(job_id)))


def list_jobs(address: str | None = None) -> list[dict[str, Any]]:
    client = connect(address)
    try:
        jobs = client.list_jobs()
    except Exception as error:  # noqa: BLE001
        raise JobsApiError(
            f"listing jobs at {client.get_address()}: {_first_line(error)}"
        ) from None
    return [
        {
            "job_id": job.submission_id or job.job_id,
            "status": str(job.status.value),
            "entrypoint": job.entrypoint,
            "start_time": job.start_time,
        }
        for job in sorted(jobs, key=lambda job: job.start_time or 0)
    ]
