"""The job driver: one distillation job on Ray, end to end (``distill run``).

1. join the cluster at ``address`` (or start an embedded local Ray on loopback);
2. train (or resume, or reuse) the causal teacher and warm up the student, each phase a Ray
   task on the job's run directory (``RUN/teacher``, ``RUN/student``);
3. place ``cluster.teacher.count`` teacher replicas and check them from here: compatible
   with the student, one model, deterministic (:mod:`services.jobs.checks`);
4. place the learner (``RUN/opd``: contract, checkpoints, TensorBoard curves), which
   resumes from its newest checkpoint, and ``cluster.rollout.count`` rollout workers;
5. train to the end while showing progress, watching every actor: Ray restarts a teacher
   replica or rollout worker whose process died (``cluster.<role>.max_restarts``; the
   replica serves again on its address, the worker's lost shard is handed out again); an
   actor gone for good, or the learner, ends the job with an error naming it -- except a
   rollout worker whose actor died for good while others remain (its node was preempted),
   or any host of a rollout slice (the slice was preempted; a host of the teacher's or the
   learner's slice still ends the job): the driver frees what is left of it (its other host
   actors and the slice's reservation), the learner hands its shard out again at once, the
   job goes on with the survivors, and the result names what was lost (for a slice: its name
   and pod type); a step that
   waits longer than ``cluster.step_timeout_s`` for its rollouts fails naming the missing
   rows; and when no step completes for ``cluster.watchdog_s`` the job fails naming the
   stage that stalled (rollout, teacher or learner) instead of hanging.

A role with ``cluster.<role>.slice`` set is placed on whole TPU slices instead (one slice
per teacher replica, per rollout worker group, and for the learner; :func:`place_role`):
one host actor per host, all one ``jax.distributed`` world, host 0 the role's endpoint.
A rollout slice that lost a host is not placed again: its world cannot be rejoined, so a
new world on a new slice would be needed, and a preempted slice's capacity is rarely back
within a job; the job finishes on the others, and a rerun places the full count again.

The driver imports neither JAX nor the model code: actors do, in their own processes.
Rerunning the same command resumes: finished phases are reused, OPD continues from its
newest checkpoint and regenerates the rollouts that were in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distill.data.stream import TaskStream, encode_example
from distill.job import JobPlan, job_teacher_tokenizer
from services.cluster import actors
from services.cluster.placement import actor_options, process_environment, start_ray
from services.common.auth import read_token
from services.common.config import JobSpec, RoleConfig
from services.jobs.checks import check_teachers

Log = Callable[[str], None]


class JobFailed(RuntimeError):
    """The job stopped: the message names the actor or stage that failed."""


def actor_name(run_dir: str | Path, role: str) -> str:
    """The Ray name of a job's actor: ``role`` (``teacher-0``, ``learner``, ``rollout-1``)
    prefixed with a tag of the run directory, so two jobs on one cluster never share a
    name (``ray list actors``; ``ray.get_actor(name)`` from the job's driver)."""
    tag = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:10]
    return f"distill-{tag}-{role}"


class Watchdog:
    """Fails the job when no training step completes within ``limit_s`` seconds (``None``:
    never), naming the stage the learner reports (``rollout``, ``teacher``, ``learner``).

    :meth:`observe` takes each learner status (``None`` when the learner did not answer);
    a status whose ``step`` is past the last one seen restarts the clock. ``clock`` is
    injectable for tests."""

    def __init__(
        self, limit_s: float | None, step: int, *, clock: Callable[[], float] = time.monotonic
    ):
        self.limit_s = limit_s
        self.step = step
        self.clock = clock
        self.since = clock()
        self.status: dict[str, Any] = {}
        self.answered = True

    def observe(self, status: dict[str, Any] | None) -> None:
        """Record ``status``; raises :class:`JobFailed` once the limit has passed."""
        now = self.clock()
        self.answered = status is not None
        if status:
            self.status = status
            if status.get("step", self.step) > self.step:
                self.step, self.since = status["step"], now
        if self.limit_s is not None and now - self.since > self.limit_s:
            raise JobFailed(self.message())

    def message(self) -> str:
        if self.answered and self.status:
            stage = self.status.get("stage", "learner")
            detail = self.status.get("stage_detail", "")
        else:
            stage, detail = "learner", "the learner did not answer its status call"
        return (
            f"`watchdog`: no step completed in {self.limit_s:g} s (cluster.watchdog_s; "
            f"the last completed step is {self.step}); stalled in {stage}: {detail}"
        )


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished job reports: per-step metrics of this run, the OPD evaluations
    (including earlier runs'), the learner's final status, the actors placed and the rollout
    workers lost on the way (``"rollout worker 1: <why>"``; on a slice ``"rollout worker 1:
    host 1 of TPU slice 'name' (pod type v4-16) died: <why>"``; the job went on without
    them)."""

    run_dir: Path
    history: list[dict[str, float]]
    evaluations: list[dict[str, Any]]
    status: dict[str, Any]
    actors: dict[str, int]
    teacher_addresses: list[str]
    lost: tuple[str, ...] = ()


@dataclasses.dataclass
class PlacedActor:
    """One actor of a role as the driver uses it. ``endpoint``: the actor the driver and
    the other roles call (a slice's host 0). ``hosts``: the slice's other hosts (empty for
    a single-process actor). ``group``: the :class:`~services.cluster.tpu.SliceGroup`
    holding the slice (``None`` off slices)."""

    endpoint: Any
    hosts: list[Any]
    group: Any = None

    def where(self) -> str:
        """The slice it holds, as a message names it (``""`` off slices)."""
        if self.group is None:
            return ""
        return f"TPU slice {self.group.slice_name!r} (pod type {self.group.request.pod_type})"

    def release(self) -> None:
        import ray

        if self.group is not None:
            self.group.release()
        else:
            ray.kill(self.endpoint)


#: The actor class of each role placed on a TPU slice.
SLICE_CLASSES = {
    "teacher": actors.TeacherSliceHost,
    "learner": actors.LearnerSliceHost,
    "rollout": actors.RolloutSliceHost,
}
PLAIN_CLASSES = {
    "teacher": actors.TeacherReplica,
    "learner": actors.LearnerActor,
    "rollout": actors.RolloutWorkerActor,
}


def place_role(
    role: str,
    config: RoleConfig,
    label: str,
    run_dir: str | Path,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    max_concurrency: int,
    start_timeout_s: float,
    jax_platforms: str = "tpu",
) -> PlacedActor:
    """Start one actor of ``role`` (``teacher``, ``learner``, ``rollout``), called
    ``label`` (``teacher-0``, ``learner``, ``rollout-1``), built with ``*args, **kwargs``.

    Without ``config.slice``: one single-process actor with the role's resources, named
    :func:`actor_name`, returned at once (its ``start`` is waited for by the caller).
    With it: one whole slice (:func:`services.cluster.tpu.place_slice`), one
    :data:`SLICE_CLASSES` host actor per host with ``JAX_PLATFORMS=jax_platforms`` (host 0
    named :func:`actor_name`, host i that name plus ``-host-i``), returned once every host
    has joined the world; :class:`JobFailed` naming the label, accelerator type and topology
    when that does not happen within ``start_timeout_s``."""
    import ray

    from services.cluster.tpu import SlicePlacementError, place_slice

    options = actor_options(
        config,
        max_concurrency=max_concurrency,
        max_restarts=config.restarts(role),
        name=actor_name(run_dir, label),
    )
    if config.slice is None:
        actor = ray.remote(PLAIN_CLASSES[role]).options(**options).remote(*args, **(kwargs or {}))
        return PlacedActor(endpoint=actor, hosts=[])
    slice_options = {
        key: options[key] for key in ("max_concurrency", "max_restarts", "runtime_env", "name")
    }
    try:
        group = place_slice(
            SLICE_CLASSES[role],
            config.slice,
            role=label,
            args=args,
            kwargs=kwargs,
            timeout_s=start_timeout_s,
            num_cpus=config.num_cpus,
            jax_platforms=jax_platforms,
            options=slice_options,
        )
    except SlicePlacementError as error:
        raise JobFailed(f"placing {label} on a TPU slice failed: {error}") from error
    except Exception as error:
        raise JobFailed(
            f"placing {label} on a TPU slice ({config.slice.describe()}) failed: {_reason(error)}"
        ) from error
    return PlacedActor(endpoint=group.actors[0], hosts=group.actors[1:], group=group)


def _log_slice(log: Log, label: str, placed: PlacedActor) -> None:
    if placed.group is not None:
        log(f"== {label} on {placed.where()}: {len(placed.group.actors)} host(s)")


def _holds(placed: PlacedActor, label: str) -> dict[Any, str]:
    """The driver's watch on a slice's hosts other than its endpoint."""
    return {
        host.hold.remote(): f"{label} host {index}"
        for index, host in enumerate(placed.hosts, start=1)
    }


def _wait(reference, timeout_s: float | None, what: str):
    """The result of ``reference``; ``JobFailed`` naming ``what`` on failure or timeout
    (None: no deadline, for training phases whose length the job sets)."""
    import ray

    ready, _ = ray.wait([reference], timeout=timeout_s)
    if not ready:
        raise JobFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
    try:
        return ray.get(reference)
    except Exception as error:
        raise JobFailed(f"{what} failed: {_reason(error)}") from error


def _reason(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    if cause is not None and cause is not error:
        return f"{type(cause).__name__}: {cause}"
    return f"{type(error).__name__}: {error}"


def _train_phases(job: dict[str, Any], run_dir: str, progress: bool) -> None:
    """Teacher training and student warm-up (resumable; reused when finished)."""
    from distill import pipeline
    from services.common.config import JobSpec

    spec = JobSpec(**job)
    teacher, _ = pipeline.train_teacher(spec, Path(run_dir) / "teacher", progress=progress)
    if spec.student_init != "teacher":
        teacher = None
    pipeline.warmup_student(spec, Path(run_dir) / "student", teacher=teacher, progress=progress)


def run_job(
    job: JobSpec,
    run_dir: str | Path,
    *,
    address: str | None = None,
    ray_temp_dir: str | Path | None = None,
    progress: bool = True,
    log: Log = print,
    jax_platforms: str = "tpu",
) -> JobResult:
    """Run (or resume) ``job`` in ``run_dir`` on Ray (module docstring). ``jax_platforms``:
    the ``JAX_PLATFORMS`` of the roles placed on TPU slices (``cpu`` for nodes that only
    advertise TPUs, as in the tests)."""
    import ray

    run_dir = Path(run_dir).absolute()
    cluster = job.cluster
    plan = JobPlan.from_job(job)
    payload = job.model_dump(mode="json")
    if cluster.token_file is not None:
        # A missing or world-readable token file fails now, not after the warm-up phases.
        read_token(cluster.token_file)
    started_ray = start_ray(address, cluster, ray_temp_dir)
    placed: list[PlacedActor] = []
    try:
        log(f"== phases: teacher and student warm-up in {run_dir}")
        phase_task = ray.remote(num_cpus=1, runtime_env={"env_vars": process_environment()})(
            _train_phases
        )
        _wait(
            phase_task.remote(payload, str(run_dir), progress),
            None,
            "teacher training and student warm-up",
        )

        launch = uuid.uuid4().hex  # a restarted replica finds its own address record
        teachers: list[PlacedActor] = []
        for index in range(cluster.teacher.count):
            teachers.append(
                place_role(
                    "teacher",
                    cluster.teacher,
                    f"teacher-{index}",
                    run_dir,
                    (
                        payload,
                        str(run_dir / "teacher"),
                        index,
                        str(run_dir / "cluster" / f"teacher-{index}.json"),
                        launch,
                    ),
                    max_concurrency=4,
                    start_timeout_s=cluster.start_timeout_s,
                    jax_platforms=jax_platforms,
                )
            )
            placed.append(teachers[-1])
            _log_slice(log, f"teacher-{index}", teachers[-1])
        replicas = [teacher.endpoint for teacher in teachers]
        addresses = [
            _wait(
                replica.start.remote(), cluster.start_timeout_s, f"teacher replica {index} to start"
            )
            for index, replica in enumerate(replicas)
        ]
        log(f"== {len(addresses)} teacher replica(s) serving on {', '.join(addresses)}")
        _check_teachers(job, plan, addresses)

        learner_placed = place_role(
            "learner",
            cluster.learner,
            "learner",
            run_dir,
            (payload,),
            {
                "student_run": str(run_dir / "student"),
                "opd_dir": str(run_dir / "opd"),
                "teacher_addresses": addresses,
                "shards_per_step": cluster.rollout.count,
                "teacher_run": str(run_dir / "teacher"),
            },
            max_concurrency=16,
            start_timeout_s=cluster.start_timeout_s,
            jax_platforms=jax_platforms,
        )
        placed.append(learner_placed)
        _log_slice(log, "learner", learner_placed)
        learner = learner_placed.endpoint
        started = _wait(learner.start.remote(), cluster.start_timeout_s, "the learner to start")
        log(f"== learner serving on {started['address']}, starting at step {started['step']}")

        # On slices: one rollout worker group per slice ("student slice"), host 0 its
        # endpoint (it acquires work from the learner and pushes traces).
        groups: list[PlacedActor] = []
        for index in range(cluster.rollout.count):
            groups.append(
                place_role(
                    "rollout",
                    cluster.rollout,
                    f"rollout-{index}",
                    run_dir,
                    (payload,),
                    {
                        "worker_id": f"rollout-{index}",
                        "learner_address": started["address"],
                        "learner": learner,
                    },
                    max_concurrency=2,
                    start_timeout_s=cluster.start_timeout_s,
                    jax_platforms=jax_platforms,
                )
            )
            placed.append(groups[-1])
            _log_slice(log, f"rollout-{index}", groups[-1])
        workers = [group.endpoint for group in groups]
        runs = {
            worker.run.remote(): f"rollout worker {index}" for index, worker in enumerate(workers)
        }
        # A replica's serve() lasts while it serves (made again after a restart): it ends
        # only when the replica is gone for good, which then ends the job naming it.
        runs |= {
            replica.serve.remote(): f"teacher replica {index}"
            for index, replica in enumerate(replicas)
        }
        runs |= _holds(learner_placed, "the learner")
        for index, teacher in enumerate(teachers):
            runs |= _holds(teacher, f"teacher replica {index}")
        for index, group in enumerate(groups):
            runs |= _holds(group, f"rollout worker {index}")
        watchdog = Watchdog(cluster.watchdog_s, started["step"])
        rollout = {
            f"rollout worker {index}": (f"rollout-{index}", group)
            for index, group in enumerate(groups)
        }
        result = _supervise(
            learner,
            runs,
            job.opd.steps,
            started["step"],
            progress,
            log,
            watchdog,
            rollout=rollout,
            run_dir=run_dir,
        )
        return JobResult(
            run_dir=run_dir,
            history=result["history"],
            evaluations=result["evaluations"],
            status=result["status"],
            actors={
                "teacher replicas": cluster.teacher.count,
                "rollout workers": cluster.rollout.count,
                "learner": 1,
            },
            teacher_addresses=addresses,
            lost=tuple(result["lost"]),
        )
    finally:
        for actor in placed:
            actor.release()
        if started_ray:
            ray.shutdown()


def _check_teachers(job: JobSpec, plan: JobPlan, addresses: list[str]) -> None:
    from services.teacher.client import RemoteTeacher

    token = None if job.cluster.token_file is None else read_token(job.cluster.token_file)
    clients = [
        RemoteTeacher(
            address,
            token=token,
            timeout_s=job.cluster.teacher_timeout_s,
            retry_policy=job.cluster.teacher_retry,
        )
        for address in addresses
    ]
    try:
        cross = job.teacher_tokenizer is not None
        # The probe is in the teacher's ids: with another tokenizer, the teacher's own.
        probe_tokenizer = job_teacher_tokenizer(job) if cross else plan.tokenizer
        prompt, answer = encode_example(TaskStream(job.data).batch(0, 1)[0], probe_tokenizer)
        check_teachers(
            clients,
            addresses,
            plan.tokenizer,
            job.student.vocab_size,
            prompt + answer,
            cross_tokenizer_ok=cross,
        )
    finally:
        for client in clients:
            client.close()


def _newest_checkpoint(run_dir: Path | None) -> int | None:
    """The step of the newest finished OPD checkpoint in ``run_dir`` (None: none yet)."""
    if run_dir is None:
        return None
    checkpoints = run_dir / "opd" / "checkpoints"
    steps = (
        [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
        if checkpoints.is_dir()
        else []
    )
    return max(steps, default=None)


def _learner_failed(error: BaseException, run_dir: Path | None) -> JobFailed:
    """The job's error for a failed learner: why, and how the job resumes (the learner is
    not restarted in place: it holds the run's state, and its workers' and teacher's
    connections; a rerun restores it from its newest checkpoint)."""
    step = _newest_checkpoint(run_dir)
    resume = (
        f"from its newest checkpoint (step {step})"
        if step is not None
        else "from the start of OPD (no checkpoint yet)"
    )
    # distill.opd.guard.PolicyRegression, by name: importing it would load JAX in the driver.
    if type(getattr(error, "cause", None) or error).__name__ == "PolicyRegression":
        return JobFailed(
            f"the learner failed: {_reason(error)} (the job's guard stopped OPD: a rerun "
            f"resumes {resume} and trips again once its window refills; lower "
            "opd.optimizer.learning_rate and use a new run directory)"
        )
    return JobFailed(
        f"the learner failed: {_reason(error)} (the learner is not restarted in place; rerun "
        f"the same command with the same run directory to resume {resume})"
    )


def _raise_if_learner_failed(run, wait_s: float = 5.0, run_dir: Path | None = None) -> None:
    """Raise :class:`JobFailed` naming the learner if its ``run`` failed (within
    ``wait_s``: Ray reports a dead process a moment after its peers notice)."""
    import ray

    ready, _ = ray.wait([run], timeout=wait_s)
    if ready:
        try:
            ray.get(run)
        except Exception as error:
            raise _learner_failed(error, run_dir) from error


def _rollout_owner(name: str, rollout: dict[str, Any]) -> str | None:
    """Which rollout worker a watched call ``name`` belongs to (its run, or one of its
    slice's hosts), if any."""
    for owner in rollout:
        if name == owner or name.startswith(f"{owner} host "):
            return owner
    return None


#: How long a failed rollout slice worker waits for Ray to report a dead host of its slice
#: (Ray's node health checks take about 15 s to declare a vanished node dead).
HOST_DEATH_WAIT_S = 30.0


def _dead_host(
    owner: str, pending: dict, wait_s: float = HOST_DEATH_WAIT_S
) -> tuple[str, BaseException] | None:
    """A host of rollout worker ``owner``'s slice whose watched ``hold`` (in ``pending``)
    fails with the actor's death within ``wait_s``: ``(its name, the error)``, taken out of
    ``pending``; ``None`` when none does (or ``owner`` has no slice)."""
    import ray

    holds = [ref for ref, name in pending.items() if name.startswith(f"{owner} host ")]
    deadline = time.monotonic() + wait_s
    while holds:
        ready, holds = ray.wait(holds, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as error:
            return pending.pop(ready[0]), error
        except Exception:
            continue
    return None


def _why_lost(name: str, owner: str, placed: PlacedActor, error: BaseException) -> str:
    """Why rollout worker ``owner`` is lost, given that its watched call ``name`` (its run,
    or ``"<owner> host <i>"``: a host of its slice) failed with ``error``; on a slice, which
    host of which slice died."""
    if placed.group is None:
        return _reason(error)
    host = name.removeprefix(owner).strip() or "host 0 (its endpoint)"
    return f"{host} of {placed.where()} died: {_reason(error)}"


def _supervise(
    learner,
    runs: dict,
    steps: int,
    start: int,
    progress: bool,
    log: Log,
    watchdog: Watchdog,
    *,
    rollout: dict[str, tuple[str, PlacedActor]] | None = None,
    run_dir: Path | None = None,
) -> dict:
    """Wait for the learner's run while watching the other actors' long calls (``runs``:
    reference -> name; one that fails ends the job naming it) and the ``watchdog``; show
    progress. ``rollout``: ``{"rollout worker i": (worker id, placed)}``; a rollout worker
    whose actor died for good (its node or slice was preempted) is dropped instead, and its
    shards handed out again at once, while another one remains. The result's ``lost`` lists
    what was dropped and why."""
    import ray
    import tqdm

    rollout = dict(rollout or {})
    run = learner.run.remote()
    bar = tqdm.tqdm(total=steps, initial=start, desc="opd", unit="step", disable=not progress)
    pending = dict(runs)
    lost: list[str] = []
    printed = 0
    try:
        while True:
            ready, _ = ray.wait([run, *pending], num_returns=1, timeout=1.0)
            if run in ready:
                try:
                    result = ray.get(run)
                except Exception as error:
                    raise _learner_failed(error, run_dir) from error
                bar.update(steps - bar.n)
                for line in result["log"][printed:]:
                    log(line)
                return {**result, "lost": lost}
            for reference in ready:
                if reference not in pending:  # dropped with its rollout worker meanwhile
                    continue
                name = pending.pop(reference)
                try:
                    ray.get(reference)
                except Exception as error:
                    # A dead learner fails its workers' calls too: name the cause.
                    _raise_if_learner_failed(run, run_dir=run_dir)
                    owner = _rollout_owner(name, rollout)
                    if owner is not None and not isinstance(error, ray.exceptions.RayActorError):
                        # A slice's worker may fail in its broken world before the driver
                        # sees the host that died: that host is then what was lost.
                        name, error = _dead_host(owner, pending) or (name, error)
                    if owner is None or not isinstance(error, ray.exceptions.RayActorError):
                        raise JobFailed(f"{name} failed: {_reason(error)}") from error
                    why = _why_lost(name, owner, rollout[owner][1], error)
                    lost.append(f"{owner}: {why}")
                    _drop_rollout_worker(learner, owner, rollout, pending)
                    if not rollout:
                        raise JobFailed(
                            "every rollout worker is gone: " + "; ".join(lost)
                        ) from error
                    log(
                        f"== {owner} is gone ({why}); going on with {len(rollout)} rollout worker(s)"
                    )
                    continue
                if " host " in name:
                    raise JobFailed(f"{name} left its TPU slice's world while the job ran")
                if name.startswith("teacher replica"):
                    raise JobFailed(f"{name} stopped serving while the job ran")
            try:
                status = ray.get(learner.status.remote(), timeout=30)
                lines = ray.get(learner.log_lines.remote(printed), timeout=30)
            except ray.exceptions.GetTimeoutError:
                watchdog.observe(None)
                continue
            except ray.exceptions.RayActorError as error:
                # The learner died between two looks at its run: its run fails with the
                # cause a moment later; name the learner either way.
                _raise_if_learner_failed(run, run_dir=run_dir)
                raise _learner_failed(error, run_dir) from error
            watchdog.observe(status)
            for line in lines:
                bar.write(line) if progress else log(line)
            printed += len(lines)
            if status:
                bar.update(status["step"] - bar.n)
                bar.set_postfix(
                    queued=status["queued_rows"], stale=status["dropped_stale_rows"], refresh=False
                )
            time.sleep(0.2)
    finally:
        bar.close()


def _drop_rollout_worker(
    learner, owner: str, rollout: dict[str, tuple[str, PlacedActor]], pending: dict
) -> None:
    """Stop watching rollout worker ``owner`` (its run and its slice's hosts), release what
    is left of it (a slice's world does not survive losing a host), and have the learner
    hand out its shards again now rather than after ``reassign_after_s``."""
    import ray

    worker_id, placed = rollout.pop(owner)
    for reference, name in list(pending.items()):
        if _rollout_owner(name, {owner: None}) is not None:
            del pending[reference]
    with contextlib.suppress(Exception):  # gone with its node already: nothing to free
        placed.release()
    # A busy or dying learner still hands the shard out after reassign_after_s.
    with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        ray.get(learner.release_worker.remote(worker_id), timeout=30)
