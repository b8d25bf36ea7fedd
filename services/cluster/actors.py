"""Ray actor classes of a distillation job: teacher replicas, the learner, rollout workers.

Plain classes: :mod:`services.cluster.placement` wraps them with ``ray.remote`` and the
resources of the job's ``cluster:`` section. Each takes the job as a plain dict (the
validated :class:`~services.common.config.JobSpec` dumped), imports JAX and the library only
inside its methods (so importing this module, as the driver does, stays light), and starts
or reaches gRPC services on the configured host.

- :class:`TeacherReplica`: the trained causal teacher behind the teacher scoring server.
  Restarted by Ray after a crash, it serves again on the same port (recorded in
  ``address_file``), so the learner's channel finds it again; :meth:`TeacherReplica.serve`
  lasts as long as the server does, so the driver sees a replica that is gone for good.
- :class:`LearnerActor`: :class:`~services.learner.service.LearnerRuntime` (the student,
  the run contract and checkpoints, ``LearnerService``); publishes each policy version's
  weights to the Ray object store (:meth:`LearnerActor.weights` hands out the reference).
  Threaded, so weight and status calls are served while :meth:`LearnerActor.run` trains.
- :class:`RolloutWorkerActor`: a :class:`~services.rollout.worker.RolloutWorker`.
- :class:`TeacherSliceHost`, :class:`LearnerSliceHost`, :class:`RolloutSliceHost`: one
  host each of a role placed on a TPU slice (``cluster.<role>.slice``): every host joins the
  role's ``jax.distributed`` world, host 0 runs the role and is its endpoint.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

#: Ray metric names the actors export (through Ray's own Prometheus exporter).
METRIC_PREFIX = "distill_"


def _configure_cpu_threads(threads: int | None) -> None:
    """Limit XLA's CPU backend to ``threads`` threads (``cluster.<role>.cpu_threads``, also
    passed as ``DISTILL_CPU_THREADS``) and the process to ``DISTILL_CPU_AFFINITY`` cores
    (``cluster.<role>.cpu_affinity``); must run before JAX is imported in the process."""
    cores = os.environ.get("DISTILL_CPU_AFFINITY")
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(core) for core in cores.split(",")})
    threads = threads or int(os.environ.get("DISTILL_CPU_THREADS", "0")) or None
    if threads is None:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
        f"intra_op_parallelism_threads={threads}"
    ).strip()


def _job(job: dict[str, Any]):
    from services.common.config import JobSpec

    return JobSpec(**job)


def _advertised(bound: str) -> str:
    """The address other nodes dial for a server bound at ``bound``: a wildcard bind
    (``0.0.0.0`` / ``::``) is reached at this node's IP, which Ray knows."""
    host, _, port = bound.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        import ray

        node = ray.util.get_node_ip_address()
        return f"[{node}]:{port}" if ":" in node else f"{node}:{port}"
    return bound


def _token(job) -> str | None:
    from services.common.auth import read_token

    return None if job.cluster.token_file is None else read_token(job.cluster.token_file)


class TeacherReplica:
    """One teacher scoring server holding the trained teacher of ``teacher_run``.

    ``address_file``: where :meth:`start` records the bound address with ``launch`` (an id
    the driver draws per job launch). A process Ray restarts after a crash
    (``max_restarts``) is built with the same arguments, finds its launch's record, and
    starts serving again in its constructor on that same port, so clients holding the old
    address (the learner's channel) reach it again once it is up; their calls meanwhile are
    retried (``cluster.teacher_retry``). A record of another launch is ignored."""

    def __init__(
        self,
        job: dict[str, Any],
        teacher_run: str,
        replica: int = 0,
        address_file: str | None = None,
        launch: str = "",
    ):
        self.job = _job(job)
        _configure_cpu_threads(self.job.cluster.teacher.cpu_threads)
        from distill.cache import enable_compile_cache

        # A replica Ray restarts reads its compiled programs back instead of compiling them
        # again, which keeps the restart inside the clients' retry budget.
        enable_compile_cache()
        self.teacher_run = teacher_run
        self.replica = replica
        self.address_file = address_file
        self.launch = launch
        self.server = None
        recorded = self._recorded_address()
        if recorded is not None:  # a restart: serve where the first process served
            self.start(port=int(recorded.rpartition(":")[2]))

    def _recorded_address(self) -> str | None:
        if self.address_file is None or not self.launch:
            return None
        try:
            with open(self.address_file, encoding="utf-8") as opened:
                record = json.load(opened)
        except (OSError, ValueError):
            return None
        return record.get("address") if record.get("launch") == self.launch else None

    def start(self, port: int = 0) -> str:
        """Load the teacher, serve it on ``port`` (0: any free one; recorded in
        ``address_file``); returns the advertised ``host:port``. Serving already: its
        address."""
        from distill import pipeline
        from distill.teacher import InProcessTeacher
        from services.teacher.server import TeacherServerConfig, serve_teacher

        if self.server is None:
            model = pipeline.load_teacher_run(self.job, self.teacher_run)
            # Its own tokenizer: Score for a same-tokenizer student, ScoreText for another.
            teacher = InProcessTeacher(model, pipeline.job_teacher_tokenizer(self.job))
            config = TeacherServerConfig(
                address=f"{self.job.cluster.host}:{port}", token=_token(self.job)
            )
            self.server = serve_teacher(teacher, config)
            if self.address_file is not None:
                os.makedirs(os.path.dirname(self.address_file), exist_ok=True)
                written = f"{self.address_file}.{os.getpid()}"
                with open(written, "w", encoding="utf-8") as record:
                    json.dump({"launch": self.launch, "address": self.server.address}, record)
                os.replace(written, self.address_file)
        return _advertised(self.server.address)

    def serve(self) -> None:
        """Return when the server stops (never, while the job runs): the driver watches
        this call, which Ray makes again on a restarted replica and fails once the replica
        is gone for good."""
        if self.server is None:
            raise RuntimeError("`server` must be started first (call start())")
        while not self.server.wait(60.0):
            pass

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        import dataclasses

        return {} if self.server is None else dataclasses.asdict(self.server.stats())

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class LearnerActor:
    """The job's learner (module docstring). ``teacher_addresses``: the replicas' addresses
    (one round-robin channel). ``opd_dir``: the OPD run directory (contract, checkpoints,
    TensorBoard curves); ``student_run``: the finished warm-up run it starts from."""

    def __init__(
        self,
        job: dict[str, Any],
        *,
        student_run: str,
        opd_dir: str,
        teacher_addresses: list[str],
        shards_per_step: int,
        teacher_run: str | None = None,
    ):
        self.job = _job(job)
        _configure_cpu_threads(self.job.cluster.learner.cpu_threads)
        self.student_run, self.opd_dir = student_run, opd_dir
        self.teacher_run = teacher_run
        self.teacher_addresses = list(teacher_addresses)
        self.shards_per_step = shards_per_step
        self.runtime = None
        self._published: dict[int, Any] = {}
        self._condition = threading.Condition()
        self._metrics: dict[str, Any] = {}
        self._log: list[str] = []
        self._hold_version: int | None = None
        self._holding = threading.Event()

    def _publish(self, version: int, weights: dict[str, Any]) -> None:
        """Make ``version`` fetchable: its weights go to the object store first, and only
        then is the reference handed out (:meth:`weights`), so a worker sees a version whole
        or not at all; a learner that dies between the two publishes nothing."""
        import ray

        reference = ray.put(weights)
        if version == self._hold_version:
            # Fault injection (hold_publication): stop here, in the middle of publishing,
            # until the test kills this process (bounded, then publishing goes on).
            self._holding.set()
            time.sleep(self.job.cluster.step_timeout_s)
        keep = version - self.job.loss.max_staleness - 1
        with self._condition:
            self._published[version] = reference
            for old in [v for v in self._published if v < keep]:
                del self._published[old]
            self._condition.notify_all()

    def _record_metrics(self, metrics: dict[str, float]) -> None:
        from ray.util import metrics as ray_metrics

        if not self._metrics:
            gauges = (
                "queued_rows",
                "staleness",
                "dropped_stale_rows",
                "publish_seconds",
                "teacher_seconds",
                "step_seconds",
                "tokens_per_forward",
                "tokens_per_second",
                "loss",
            )
            self._metrics = {
                name: ray_metrics.Gauge(METRIC_PREFIX + name, description=f"OPD learner {name}")
                for name in gauges
            }
            self._metrics["steps"] = ray_metrics.Counter(
                METRIC_PREFIX + "steps", description="OPD updates applied"
            )
        for name, gauge in self._metrics.items():
            if name == "steps":
                gauge.inc()
            elif name in metrics:
                gauge.set(float(metrics[name]))

    def start(self) -> dict[str, Any]:
        """Load the student, reach the teacher, open (or resume) the run and serve
        ``LearnerService``; returns ``{"address", "step"}``."""
        from flax import nnx

        from distill import pipeline
        from distill.opd.learner import OpdLearner
        from services.common.config import ServerConfig
        from services.learner.service import LearnerRuntime
        from services.teacher.client import RemoteTeacher

        job = self.job
        teacher_model = None
        if job.student_init == "teacher":
            teacher_model = pipeline.load_teacher_run(job, self.teacher_run)
        student = pipeline.load_student_run(job, self.student_run, teacher=teacher_model)
        del teacher_model
        token = _token(job)
        teacher = RemoteTeacher(
            addresses=self.teacher_addresses,
            token=token,
            timeout_s=job.cluster.teacher_timeout_s,
            retry_policy=job.cluster.teacher_retry,
        )
        learner = OpdLearner(
            job,
            student,
            teacher,
            pipeline.job_tokenizer(job),
            run_dir=self.opd_dir,
            trace_dir=os.path.join(self.opd_dir, "traces") if job.cluster.record_traces else None,
            log=self._log.append,
        )
        self.runtime = LearnerRuntime(
            learner,
            shards_per_step=self.shards_per_step,
            publish=self._publish,
            server_config=ServerConfig(address=f"{job.cluster.host}:0", token=token),
            step_timeout_s=job.cluster.step_timeout_s,
            # A shard out for half the step's budget is handed to another worker, so a
            # dead worker costs at most that before the step can still complete.
            reassign_after_s=job.cluster.step_timeout_s / 2,
            tensorboard_dir=os.path.join(self.opd_dir, "tensorboard"),
            on_metrics=self._record_metrics,
        )
        del nnx
        address = _advertised(self.runtime.start())
        return {"address": address, "step": learner.step}

    def weights(self, version: int, timeout_s: float = 600.0) -> list[Any]:
        """``[reference]`` to the published weights of ``version`` (waiting for them up to
        ``timeout_s``). Wrapped in a list so Ray hands out the reference, not the value."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while version not in self._published:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"weights of policy version {version} were not published within "
                        f"{timeout_s:.0f} s (published: {sorted(self._published)})"
                    )
                self._condition.wait(remaining)
            return [self._published[version]]

    def hold_publication(self, version: int) -> None:
        """Fault injection for tests: the publication of ``version`` stops half-way (its
        weights in the object store, not yet handed out) for up to ``step_timeout_s``, so a
        test can kill the learner at exactly that point (:meth:`publication_held` tells when
        it is there)."""
        self._hold_version = version

    def publication_held(self) -> bool:
        """Whether the publication held by :meth:`hold_publication` has reached the hold."""
        return self._holding.is_set()

    def release_worker(self, worker_id: str) -> int:
        """Hand out again at once the shards rollout worker ``worker_id`` holds (the driver
        saw it gone for good); returns how many."""
        if self.runtime is None:
            return 0
        released = self.runtime.scheduler.release(worker_id)
        self._log.append(f"{worker_id} is gone: {released} shard(s) it held handed out again")
        return released

    def run(self) -> dict[str, Any]:
        """Train to the end; returns this call's metrics, the evaluations and the status."""
        history = self.runtime.run()
        learner = self.runtime.learner
        return {
            "history": history,
            "evaluations": [{"step": at, **report.to_dict()} for at, report in learner.reports],
            "status": self.runtime.status(),
            "log": list(self._log),
        }

    def status(self) -> dict[str, Any]:
        return {} if self.runtime is None else self.runtime.status()

    def pid(self) -> int:
        return os.getpid()

    def log_lines(self, start: int = 0) -> list[str]:
        return self._log[start:]

    def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()


class RolloutWorkerActor:
    """One rollout worker; ``learner`` is the learner actor's handle (for weights)."""

    def __init__(self, job: dict[str, Any], *, worker_id: str, learner_address: str, learner):
        self.job = _job(job)
        _configure_cpu_threads(self.job.cluster.rollout.cpu_threads)
        self.worker_id = worker_id
        self.learner_address = learner_address
        self.learner = learner
        self.stop_event = threading.Event()

    def _fetch(self, version: int) -> dict[str, Any]:
        import ray

        timeout = self.job.cluster.step_timeout_s
        (reference,) = ray.get(self.learner.weights.remote(version, timeout), timeout=timeout + 30)
        return ray.get(reference, timeout=timeout)

    def run(self) -> dict[str, float]:
        """Roll out assigned shards until the learner answers DONE."""
        from services.rollout.worker import RolloutWorker

        worker = RolloutWorker(
            self.job,
            worker_id=self.worker_id,
            learner_address=self.learner_address,
            fetch_weights=self._fetch,
            token=_token(self.job),
            call_timeout_s=self.job.cluster.step_timeout_s,
            retry_policy=self.job.cluster.learner_retry,
        )
        try:
            return worker.run(self.stop_event)
        finally:
            worker.close()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker runs on (which slice a preemption takes)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self.stop_event.set()


class _SliceHost:
    """One host of a role placed on a TPU slice (``cluster.<role>.slice``; see
    :func:`services.cluster.tpu.place_slice`): mixed in before the role's class.

    What runs where, on a slice of n hosts:

    - every host joins the role's ``jax.distributed`` world in its constructor
      (:func:`services.cluster.tpu.join_world`: process id = the host's TPU worker id,
      worker 0 the coordinator) and brings the backend up; that is the only step the whole
      world takes together;
    - host 0 is the role's endpoint: it alone builds the role (the teacher's gRPC server,
      the learner, the rollout worker) and runs it as a single-process program on its own
      local devices (the first one, unsharded), and the driver and the other roles talk
      only to it;
    - hosts 1..n-1 build nothing: they hold their chips and wait (:meth:`hold`), which the
      driver watches so a host that dies ends the job naming it (a rollout slice's is
      dropped instead, the job going on with the other slices);
    - checkpoints (the learner's, and the runs the teacher and the student are loaded
      from) are read and written by process 0 alone
      (:func:`distill.checkpoint.set_checkpoint_processes`), so Orbax never waits for the
      holding hosts. Nothing is sharded across the slice's hosts."""

    def __init__(self, job: dict[str, Any], *args: Any, **kwargs: Any):
        from services.cluster.tpu import join_world

        _configure_cpu_threads(None)  # before JAX is imported here
        self.world = join_world(timeout_s=_job(job).cluster.start_timeout_s)
        self.endpoint = self.world["process_id"] == 0
        self._held = threading.Event()
        if self.endpoint:
            if self.world["num_processes"] > 1:
                from distill.checkpoint import set_checkpoint_processes

                # Before the role opens any run: Orbax synchronizes the processes a
                # checkpointer names, and the other hosts never open one.
                set_checkpoint_processes({0})
            super().__init__(job, *args, **kwargs)

    def world_info(self) -> dict[str, Any]:
        """Who this process is in its world (``join_world``'s answer), where it runs
        (``node_id``, the node's TPU labels, ``TPU_WORKER_ID``), and ``endpoint``."""
        import ray

        context = ray.get_runtime_context()
        labels = context.get_node_labels()
        return {
            **self.world,
            "endpoint": self.endpoint,
            "node_id": context.get_node_id(),
            "node_slice_name": labels.get("ray.io/tpu-slice-name"),
            "node_worker_id": labels.get("ray.io/tpu-worker-id"),
            "tpu_worker_id_env": os.environ.get("TPU_WORKER_ID"),
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "pid": os.getpid(),
        }

    def hold(self) -> None:
        """Return only when :meth:`release_hold` is called: the driver watches this call on
        every host but the endpoint, so a host that dies ends the job naming it (or, on a
        rollout slice, drops the slice)."""
        while not self._held.wait(60.0):
            pass

    def release_hold(self) -> None:
        self._held.set()


class TeacherSliceHost(_SliceHost, TeacherReplica):
    """A host of a teacher replica placed on a TPU slice (host 0 serves)."""


class LearnerSliceHost(_SliceHost, LearnerActor):
    """A host of the learner placed on a TPU slice (host 0 trains and serves)."""


class RolloutSliceHost(_SliceHost, RolloutWorkerActor):
    """A host of a rollout worker group ("student slice") placed on a TPU slice (host 0
    acquires work from the learner and pushes traces)."""
