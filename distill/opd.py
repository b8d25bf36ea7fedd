"""The in-process on-policy distillation loop: rollout -> teacher score -> exact packed replay
-> weighted loss -> optax update. The services run this same code split across processes.

- :func:`prepare_batch` turns a rollout :class:`~distill.diffusion.denoise.Trace` into a
  :class:`PreparedBatch`: OPD weights (completion through the first stop token; invalid rows
  zeroed and counted), and the teacher's log-prob of every generated token, scored on the
  prompt + completion through the first stop only (nothing after the stop is seen).
- :func:`opd_update` replays the trace under the live student (packed, block-sparse),
  evaluates the configured :class:`~distill.losses.OpdLoss` with the trace's
  ``action_logps`` as behaviour log-probs, and applies one optimizer update.
- :func:`run_opd` loops over the data stream and evaluates accuracy vs tokens per forward
  (temperature 1) with diversity.

The teacher must be compatible with the student (vocabulary, special ids, tokenizer hash);
:func:`run_opd` checks it before any step. Only ``loss.kind = reverse_kl`` is wired into
the loop so far (it needs the teacher's log-prob of each sampled token only); the
full-vocabulary kinds need the teacher's distributions from the scoring call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from distill.config import JobConfig, PhaseConfig
from distill.data.stream import TaskStream, encode_example
from distill.data.tasks import answer_horizon
from distill.diffusion.denoise import SamplingSettings, Trace, rollout
from distill.diffusion.replay import num_steps_bucket, replay_packed
from distill.evaluate import EvalReport, evaluate_student
from distill.losses import OpdLoss, opd_weights
from distill.models.transformer import Transformer
from distill.teacher import Teacher, check_compatible
from distill.tokenizer import Tokenizer
from distill.train import make_train_state

Log = Callable[[str], None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """What the learner trains on: the trace plus ``weights`` ``[B, L]`` float32,
    ``teacher_logps`` ``[B, L]`` float32 (0 where the weight is 0) and ``invalid_rows``
    ``[B]`` bool (rows whose weights were zeroed because they broke an invariant) and the
    ``policy_version`` (int32 scalar: data, not a static, so it never triggers a compile)."""

    trace: Trace
    weights: jax.Array
    teacher_logps: jax.Array
    invalid_rows: jax.Array
    policy_version: jax.Array


def teacher_sequences(trace: Trace, visible: np.ndarray) -> list[list[int]]:
    """Each row's teacher-visible tokens in logical order (prompt + completion through the
    first stop). Positions are 0..n-1 over a row's valid slots, so slot order is logical."""
    tokens, positions = np.asarray(trace.tokens), np.asarray(trace.positions)
    out = []
    for row in range(tokens.shape[0]):
        slots = np.flatnonzero(visible[row])
        out.append(tokens[row, slots[np.argsort(positions[row, slots])]].tolist())
    return out


def prepare_batch(
    trace: Trace, teacher: Teacher, tokenizer: Tokenizer, *, policy_version: int = 0
) -> PreparedBatch:
    """Weights and teacher scores for a trace; a non-finite teacher value on a weighted
    token is an error."""
    weights, visible, invalid = opd_weights(
        trace.tokens,
        trace.completion_mask,
        trace.positions,
        trace.segment_ids,
        stop_ids=tokenizer.special.stop_ids,
    )
    weights, visible = np.asarray(weights), np.asarray(visible)
    positions = np.asarray(trace.positions)
    teacher_logps = np.zeros(weights.shape, np.float32)
    rows = [row for row in range(weights.shape[0]) if visible[row].sum() >= 2]
    sequences = teacher_sequences(trace, visible)
    scored = teacher.score([sequences[row] for row in rows]) if rows else []
    for row, result in zip(rows, scored, strict=True):
        slots = np.flatnonzero(visible[row])
        slots = slots[positions[row, slots] >= 1]
        # Entry i of the result scores logical position i + 1.
        teacher_logps[row, slots] = result.log_probs[positions[row, slots] - 1]
    bad = (weights > 0) & ~np.isfinite(teacher_logps)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise ValueError(f"`teacher_logps` must be finite on weighted tokens; row {row} is not")
    return PreparedBatch(
        trace=trace,
        weights=jnp.asarray(weights, jnp.float32),
        teacher_logps=jnp.asarray(np.where(weights > 0, teacher_logps, 0.0), jnp.float32),
        invalid_rows=jnp.asarray(invalid),
        policy_version=jnp.int32(policy_version),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "num_chunks"), donate_argnums=(1,))
def _opd_step(graphdef, state, prepared: PreparedBatch, *, loss: OpdLoss, num_chunks: int):
    optimizer, model = nnx.merge(graphdef, state)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    trace = prepared.trace

    def objective(params):
        student = nnx.merge(graph, params, rest)
        student_logps = replay_packed(student, trace, num_chunks=num_chunks)
        terms = loss(
            weights=prepared.weights,
            student_logps=student_logps,
            behaviour_logps=trace.action_logps,
            teacher_logps=prepared.teacher_logps,
            order=trace.positions,
        )
        return terms.value(), terms

    (value, terms), grads = jax.value_and_grad(objective, has_aux=True)(params)
    optimizer.update(model, grads)
    weight = jnp.sum(prepared.weights)
    metrics = {
        "loss": value,
        "grad_norm": optax.tree.norm(grads),
        "teacher_logp": jnp.sum(prepared.teacher_logps) / jnp.maximum(weight, 1.0),
    }
    metrics |= {name: weighted.value() for name, weighted in terms.metrics.items()}
    metrics["invalid_rows"] = jnp.sum(prepared.invalid_rows)
    return nnx.state((optimizer, model)), metrics


def opd_update(
    optimizer: nnx.Optimizer, model: Transformer, prepared: PreparedBatch, loss: OpdLoss
) -> dict[str, float]:
    """One OPD optimizer update of ``model`` (in place) from a prepared batch."""
    if loss.kind != "reverse_kl":
        raise ValueError(
            f"`loss.kind` must be 'reverse_kl' in the in-process loop for now; received "
            f"{loss.kind!r}"
        )
    graphdef, state = nnx.split((optimizer, model))
    state, metrics = _opd_step(
        graphdef, state, prepared, loss=loss, num_chunks=num_steps_bucket(prepared.trace)
    )
    nnx.update((optimizer, model), state)
    return {name: float(value) for name, value in metrics.items()}


def rollout_settings(job: JobConfig, tokenizer: Tokenizer) -> SamplingSettings:
    horizon = answer_horizon(job.data.tasks, job.data.max_length)
    config = job.rollout.model_copy(update={"max_completion_length": horizon})
    return SamplingSettings.from_config(config, tokenizer.special)


def run_opd(
    job: JobConfig,
    student: Transformer,
    teacher: Teacher,
    tokenizer: Tokenizer,
    *,
    phase: PhaseConfig | None = None,
    eval_every: int | None = None,
    progress: bool = True,
    log: Log = print,
) -> tuple[list[dict[str, float]], list[tuple[int, EvalReport]]]:
    """OPD for ``phase.steps`` steps (default ``job.opd``); returns per-step metrics and
    ``(step, report)`` evaluations (before training, every ``eval_every`` steps, at the end)."""
    phase = job.opd if phase is None else phase
    check_compatible(teacher.info(), tokenizer, student.config.vocab_size)
    loss = OpdLoss.from_config(job.loss)
    settings = rollout_settings(job, tokenizer)
    optimizer = make_train_state(
        student, phase.optimizer, phase.steps if phase.optimizer.schedule == "cosine" else None
    )
    stream = TaskStream(job.data)
    evaluation = TaskStream(job.data, split="eval").batch(0, phase.eval_examples)

    def evaluate(step: int) -> EvalReport:
        report = evaluate_student(student, tokenizer, evaluation, settings, seed=job.seed)
        log(
            f"step {step}: exact match {report.overall:.3f} {report.accuracy} at "
            f"{report.tokens_per_forward:.2f} tokens/forward; agree entropy "
            f"{report.agree_entropy_bits}"
        )
        return report

    reports = [(0, evaluate(0))]
    history: list[dict[str, float]] = []
    size = stream.batch_size
    for step in tqdm.trange(phase.steps, disable=not progress, desc="opd", unit="step"):
        examples = stream.batch(step * size, size)
        prompts = [encode_example(example, tokenizer)[0] for example in examples]
        trace = rollout(student, prompts, settings, seed=job.seed, global_step=step)
        prepared = prepare_batch(trace, teacher, tokenizer, policy_version=step)
        metrics = opd_update(optimizer, student, prepared, loss)
        metrics["tokens_per_forward"] = trace.tokens_per_forward()
        metrics["cut_without_stop"] = float(1.0 - trace.stopped().mean())
        history.append(metrics)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < phase.steps:
            reports.append((step + 1, evaluate(step + 1)))
    reports.append((phase.steps, evaluate(phase.steps)))
    return history, reports
