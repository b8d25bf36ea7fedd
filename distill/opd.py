"""The in-process on-policy distillation loop: rollout -> teacher score -> exact packed replay
-> weighted loss -> optax update. The services run this same code split across processes.

- :func:`prepare_batch` turns a rollout :class:`~distill.diffusion.denoise.Trace` into a
  :class:`PreparedBatch`: OPD weights (completion through the first stop token; invalid rows
  zeroed and counted), the teacher's log-prob of every generated token and, for the
  distribution losses, its top-k ids / log-probs (the whole vocabulary for the full kinds),
  scored on the prompt + completion through the first stop only (nothing after the stop is
  seen); task rewards and group ids for GRPO.
- :func:`opd_update` replays the trace under the live student (packed, block-sparse; with
  the full sampling distributions for the full-vocabulary kinds, or its log-probs at the
  teacher's top-k ids for the top-k kinds) and, when the loss has a
  reference KL, under the frozen reference student; evaluates the configured
  :class:`~distill.losses.OpdLoss` with the trace's ``action_logps`` as behaviour log-probs;
  applies one optimizer update.
- :func:`run_opd` loops over the data stream (``data.batch_size`` prompts x
  ``loss.group_size`` rollouts per step), evaluates accuracy vs tokens per forward
  (temperature 1) with diversity and, given a run directory, checkpoints and resumes under
  the run contract with an exact data ledger.

Rollouts are a pure function of (student parameters, seed, step, row): a rollout in flight
when a run stops is regenerated identically on resume, so nothing is skipped or trained
twice. The teacher must be compatible with the student (vocabulary, special ids, tokenizer
hash); :func:`run_opd` checks it before any step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from distill.checkpoint import RunCheckpointer, extend_ledger, restored_ledger
from distill.config import JobConfig, PhaseConfig
from distill.data.stream import TaskStream, encode_example
from distill.data.tasks import Example, answer_horizon, verify
from distill.diffusion.denoise import SamplingSettings, Trace, rollout
from distill.diffusion.replay import CompletionReplay, num_steps_bucket, replay_completion
from distill.evaluate import EvalReport, completion_text, evaluate_student
from distill.losses import OpdLoss, opd_weights
from distill.models.transformer import Transformer
from distill.pipeline import phase_contract, phase_train_state
from distill.teacher import Teacher, TeacherInfo, check_compatible, model_hash
from distill.tokenizer import Tokenizer

Log = Callable[[str], None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """What the learner trains on: the trace plus ``weights`` ``[B, L]`` float32,
    ``teacher_logps`` ``[B, L]`` float32 (0 where the weight is 0), ``invalid_rows`` ``[B]``
    bool (rows whose weights were zeroed because they broke an invariant) and the
    ``policy_version`` (int32 scalar: data, not a static, so it never triggers a compile).

    Optional: ``teacher_topk_ids`` int32 / ``teacher_topk_logps`` float32 ``[B, L, k]`` (the
    teacher's top-k at each weighted token, 0 elsewhere; k = the teacher's vocabulary for
    the full-vocabulary kinds); ``rewards`` float32 / ``group_ids`` int32 ``[B]`` (task
    reward of each row and its prompt group, for GRPO)."""

    trace: Trace
    weights: jax.Array
    teacher_logps: jax.Array
    invalid_rows: jax.Array
    policy_version: jax.Array
    teacher_topk_ids: jax.Array | None = None
    teacher_topk_logps: jax.Array | None = None
    rewards: jax.Array | None = None
    group_ids: jax.Array | None = None


def teacher_sequences(trace: Trace, visible: np.ndarray) -> list[list[int]]:
    """Each row's teacher-visible tokens in logical order (prompt + completion through the
    first stop). Positions are 0..n-1 over a row's valid slots, so slot order is logical."""
    tokens, positions = np.asarray(trace.tokens), np.asarray(trace.positions)
    out = []
    for row in range(tokens.shape[0]):
        slots = np.flatnonzero(visible[row])
        out.append(tokens[row, slots[np.argsort(positions[row, slots])]].tolist())
    return out


def teacher_top_k(loss: OpdLoss, info: TeacherInfo) -> int | None:
    """How many of the teacher's entries per token the loss needs: none for ``reverse_kl``
    (the sampled token's log-prob alone), ``loss.teacher_top_k``, or the whole teacher
    vocabulary for the full-vocabulary kinds."""
    if loss.kind == "reverse_kl":
        return None
    if loss.teacher_top_k is None:
        return info.vocab_size
    if loss.teacher_top_k > info.vocab_size:
        raise ValueError(
            f"`loss.teacher_top_k` must be <= the teacher's vocabulary {info.vocab_size}; "
            f"received {loss.teacher_top_k}"
        )
    return loss.teacher_top_k


def _optional_rows(name: str, values: Sequence[float] | None, rows: int, dtype) -> jax.Array | None:
    if values is None:
        return None
    array = np.asarray(values, dtype)
    if array.shape != (rows,):
        raise ValueError(f"`{name}` must have shape [{rows}] (one per row); received {array.shape}")
    return jnp.asarray(array)


def prepare_batch(
    trace: Trace,
    teacher: Teacher,
    tokenizer: Tokenizer,
    *,
    policy_version: int = 0,
    top_k: int | None = None,
    rewards: Sequence[float] | None = None,
    group_ids: Sequence[int] | None = None,
) -> PreparedBatch:
    """Weights and teacher scores for a trace (``top_k``: also the teacher's top-k entries
    per token); a non-finite teacher log-prob on a weighted token is an error."""
    weights, visible, invalid = opd_weights(
        trace.tokens,
        trace.completion_mask,
        trace.positions,
        trace.segment_ids,
        stop_ids=tokenizer.special.stop_ids,
    )
    weights, visible = np.asarray(weights), np.asarray(visible)
    batch, length = weights.shape
    positions = np.asarray(trace.positions)
    teacher_logps = np.zeros(weights.shape, np.float32)
    topk_ids = np.zeros((batch, length, top_k or 0), np.int32)
    topk_logps = np.zeros((batch, length, top_k or 0), np.float32)
    rows = [row for row in range(batch) if visible[row].sum() >= 2]
    sequences = teacher_sequences(trace, visible)
    scored = teacher.score([sequences[row] for row in rows], top_k=top_k) if rows else []
    for row, result in zip(rows, scored, strict=True):
        slots = np.flatnonzero(visible[row])
        slots = slots[positions[row, slots] >= 1]
        # Entry i of the result scores logical position i + 1.
        entries = positions[row, slots] - 1
        teacher_logps[row, slots] = result.log_probs[entries]
        if top_k is not None:
            topk_ids[row, slots] = result.top_ids[entries]
            topk_logps[row, slots] = result.top_log_probs[entries]
    bad = (weights > 0) & ~np.isfinite(teacher_logps)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise ValueError(f"`teacher_logps` must be finite on weighted tokens; row {row} is not")
    # Top-k log-probs may be -inf (zero mass) but never NaN or +inf on a weighted token.
    bad_topk = (weights > 0) & (np.isnan(topk_logps) | (topk_logps == np.inf)).any(axis=-1)
    if bad_topk.any():
        row = int(np.argwhere(bad_topk)[0][0])
        raise ValueError(
            f"`teacher_topk_logps` must be finite or -inf on weighted tokens; row {row} holds "
            "NaN or +inf"
        )
    weighted = (weights > 0)[..., None]
    return PreparedBatch(
        trace=trace,
        weights=jnp.asarray(weights, jnp.float32),
        teacher_logps=jnp.asarray(np.where(weights > 0, teacher_logps, 0.0), jnp.float32),
        invalid_rows=jnp.asarray(invalid),
        policy_version=jnp.int32(policy_version),
        teacher_topk_ids=None if top_k is None else jnp.asarray(np.where(weighted, topk_ids, 0)),
        teacher_topk_logps=None
        if top_k is None
        else jnp.asarray(np.where(weighted, topk_logps, 0.0), jnp.float32),
        rewards=_optional_rows("rewards", rewards, batch, np.float32),
        group_ids=_optional_rows("group_ids", group_ids, batch, np.int32),
    )


def _full_teacher(ids: jax.Array, log_probs: jax.Array, vocab: int) -> jax.Array:
    """Teacher top-k (k = its whole vocabulary) -> ``[..., vocab]`` log-probs, -inf on ids
    it does not have (the student's appended mask id)."""
    full = jnp.full((*ids.shape[:-1], vocab), -jnp.inf, jnp.float32)
    return jnp.put_along_axis(full, ids, log_probs, axis=-1, inplace=False)


def _without_id(ids: jax.Array, log_probs: jax.Array, excluded: int) -> jax.Array:
    """The teacher's top-k renormalized off ``excluded`` (the mask id, which the student
    never samples: a teacher mass there would make the forward KL infinite). Exact when the
    id is among the top-k; otherwise its (small) mass stays in the tail bucket."""
    hit = ids == excluded
    mass = jnp.sum(jnp.where(hit, jnp.exp(log_probs), 0.0), axis=-1, keepdims=True)
    kept = jnp.log1p(-jnp.minimum(mass, 1.0 - 1e-6))
    return jnp.where(hit, -jnp.inf, log_probs - kept)


def _loss_inputs(
    loss: OpdLoss,
    replayed: CompletionReplay,
    prepared: PreparedBatch,
    reference_logps: jax.Array | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Everything in completion space ``[B, N]``; the weights of absent slots are 0."""
    trace, gather = prepared.trace, replayed.gather
    weights = jnp.where(replayed.present, gather(prepared.weights), 0.0)
    available = {
        "student_logps": replayed.logps,
        "behaviour_logps": gather(trace.action_logps),
        "teacher_logps": gather(prepared.teacher_logps),
        "order": gather(trace.positions),
        "student_log_probs": replayed.log_probs,
        "rewards": prepared.rewards,
        "group_ids": prepared.group_ids,
        "reference_logps": reference_logps,
    }
    if prepared.teacher_topk_ids is not None:
        ids, logps = gather(prepared.teacher_topk_ids), gather(prepared.teacher_topk_logps)
        logps = _without_id(ids, logps, trace.settings.mask_id)
        if loss.teacher_top_k is None:
            vocab = replayed.log_probs.shape[-1]
            available["teacher_log_probs"] = _full_teacher(ids, logps, vocab)
        else:
            available |= {"teacher_topk_ids": ids, "teacher_topk_logps": logps}
    inputs = {name: available.get(name) for name in loss.required_inputs()}
    if replayed.gathered_logps is not None:  # top-k: the student at the teacher's ids only
        del inputs["student_log_probs"]
        inputs["student_topk_logps"] = replayed.gathered_logps
    return weights, inputs


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "reference_graphdef", "loss", "num_chunks"),
    donate_argnums=(1,),
)
def _opd_step(
    graphdef,
    state,
    reference_state,
    prepared: PreparedBatch,
    *,
    reference_graphdef,
    loss: OpdLoss,
    num_chunks: int,
):
    optimizer, model = nnx.merge(graphdef, state)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    trace = prepared.trace
    # Full kinds need the student's whole distribution; top-k kinds only its log-probs at
    # the teacher's ids (never [B, N, V]); reverse_kl only the actions'.
    distributions = loss.kind != "reverse_kl" and loss.teacher_top_k is None
    gather_ids = None
    if loss.kind != "reverse_kl" and loss.teacher_top_k is not None:
        gather_ids = prepared.teacher_topk_ids
    reference_logps = None
    if reference_graphdef is not None:
        reference = nnx.merge(reference_graphdef, reference_state)
        reference_logps = jax.lax.stop_gradient(
            replay_completion(reference, trace, num_chunks=num_chunks).logps
        )

    def objective(params):
        student = nnx.merge(graph, params, rest)
        replayed = replay_completion(
            student,
            trace,
            num_chunks=num_chunks,
            distributions=distributions,
            gather_ids=gather_ids,
        )
        weights, inputs = _loss_inputs(loss, replayed, prepared, reference_logps)
        terms = loss(weights, **inputs)
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
    if prepared.rewards is not None:
        metrics["reward"] = jnp.mean(prepared.rewards)
    return nnx.state((optimizer, model)), metrics


def opd_update(
    optimizer: nnx.Optimizer,
    model: Transformer,
    prepared: PreparedBatch,
    loss: OpdLoss,
    *,
    reference: Transformer | None = None,
) -> dict[str, float]:
    """One OPD optimizer update of ``model`` (in place) from a prepared batch. ``reference``
    (a frozen student) is required when ``loss.kl_reference_weight > 0``."""
    if loss.kl_reference_weight > 0 and reference is None:
        raise ValueError("`reference` must be given when loss.kl_reference_weight > 0")
    if loss.kind != "reverse_kl" and prepared.teacher_topk_ids is None:
        raise ValueError(
            f"`prepared.teacher_topk_ids` must be given for loss.kind={loss.kind!r} "
            "(prepare the batch with the teacher's top-k: see `teacher_top_k`)"
        )
    if loss.task_reward_weight > 0 and (prepared.rewards is None or prepared.group_ids is None):
        raise ValueError(
            "`prepared.rewards` and `prepared.group_ids` must be given when "
            "loss.task_reward_weight > 0"
        )
    graphdef, state = nnx.split((optimizer, model))
    reference_graphdef, reference_state = None, None
    if loss.kl_reference_weight > 0:
        reference_graphdef, reference_state = nnx.split(reference)
    state, metrics = _opd_step(
        graphdef,
        state,
        reference_state,
        prepared,
        reference_graphdef=reference_graphdef,
        loss=loss,
        num_chunks=num_steps_bucket(prepared.trace),
    )
    nnx.update((optimizer, model), state)
    return {name: float(value) for name, value in metrics.items()}


def rollout_settings(job: JobConfig, tokenizer: Tokenizer) -> SamplingSettings:
    horizon = answer_horizon(job.data.tasks, job.data.max_length)
    config = job.rollout.model_copy(update={"max_completion_length": horizon})
    return SamplingSettings.from_config(config, tokenizer.special)


def task_rewards(examples: Sequence[Example], trace: Trace, tokenizer: Tokenizer) -> list[float]:
    """1.0 for each row whose stop-cut completion verifies against its example, else 0.0."""
    completions = trace.completions()
    if len(completions) != len(examples):
        raise ValueError(
            f"`examples` must hold one example per trace row ({len(completions)}); "
            f"received {len(examples)}"
        )
    return [
        float(verify(example, completion_text(tokenizer, ids)))
        for example, ids in zip(examples, completions, strict=True)
    ]


def frozen_copy(model: Transformer) -> Transformer:
    """An independent copy (fresh buffers: training donates the live model's)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def run_opd(
    job: JobConfig,
    student: Transformer,
    teacher: Teacher,
    tokenizer: Tokenizer,
    *,
    phase: PhaseConfig | None = None,
    run_dir: str | Path | None = None,
    reference: Transformer | None = None,
    eval_every: int | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    log: Log = print,
) -> tuple[list[dict[str, float]], list[tuple[int, EvalReport]]]:
    """OPD for ``phase.steps`` steps (default ``job.opd``) on ``student`` (in place).

    Returns the per-step metrics of the steps run by this call and ``(step, report)``
    evaluations (before training, every ``eval_every`` steps, at the end; a resumed run
    returns the earlier ones too). ``reference`` defaults to a frozen copy of the starting
    student (used when ``loss.kl_reference_weight > 0``).

    With ``run_dir`` the phase is resumable: the run contract holds the student's starting
    hash and the teacher's model hash besides the job's configs, a checkpoint (optimizer,
    student, data ledger, evaluations) is written every ``phase.checkpoint_every`` steps and
    at the end (or at ``stop_after``, for tests), and a call on an existing run continues
    from its newest good checkpoint.
    """
    phase = job.opd if phase is None else phase
    info = teacher.info()
    check_compatible(info, tokenizer, student.config.vocab_size)
    loss = OpdLoss.from_config(job.loss)
    top_k = teacher_top_k(loss, info)
    settings = rollout_settings(job, tokenizer)
    if reference is None and loss.kl_reference_weight > 0:
        reference = frozen_copy(student)
    stream = TaskStream(job.data)
    prompts_per_step, group_size = stream.batch_size, job.loss.group_size
    evaluation = TaskStream(job.data, split="eval").batch(0, phase.eval_examples)

    optimizer = phase_train_state(student, phase)
    checkpointer, step, ledger, reports = None, 0, [], []
    if run_dir is not None:
        contract = phase_contract(
            job,
            tokenizer,
            "opd",
            teacher_hash=info.model_hash,
            student_hash=model_hash(student),
            phase_config=phase,
        )
        checkpointer = RunCheckpointer.open(run_dir, contract)
        restored = checkpointer.restore_latest((optimizer, student))
        if restored is not None:
            step = restored.step
            log(f"resumed {run_dir} at step {step}")
            reports = [
                (int(entry["step"]), EvalReport(**entry["report"]))
                for entry in restored.progress.get("evaluations", [])
            ]
        ledger = restored_ledger(restored, step * prompts_per_step, Path(run_dir))

    def evaluate(at: int) -> None:
        report = evaluate_student(student, tokenizer, evaluation, settings, seed=job.seed)
        log(
            f"step {at}: exact match {report.overall:.3f} {report.accuracy} at "
            f"{report.tokens_per_forward:.2f} tokens/forward; agree entropy "
            f"{report.agree_entropy_bits}"
        )
        reports.append((at, report))

    def save(at: int, last: dict[str, float]) -> None:
        if checkpointer is None:
            return
        progress_record = {
            "data_position": at * prompts_per_step,
            "ledger": ledger,
            "policy_version": at,
            "evaluations": [{"step": s, "report": r.to_dict()} for s, r in reports],
            "last": last,
        }
        checkpointer.save(at, (optimizer, student), progress_record)

    if step == 0:
        evaluate(0)
    history: list[dict[str, float]] = []
    end = phase.steps if stop_after is None else min(phase.steps, stop_after)
    start = step
    for step in tqdm.trange(start, end, disable=not progress, desc="opd", unit="step"):
        examples = stream.batch(step * prompts_per_step, prompts_per_step)
        rows = [example for example in examples for _ in range(group_size)]
        prompts = [encode_example(example, tokenizer)[0] for example in rows]
        # The rollout's randomness is a function of (seed, step, row): resumable exactly.
        trace = rollout(student, prompts, settings, seed=job.seed, global_step=step)
        rewards = group_ids = None
        if loss.task_reward_weight > 0:
            rewards = task_rewards(rows, trace, tokenizer)
            group_ids = [row // group_size for row in range(len(rows))]
        prepared = prepare_batch(
            trace,
            teacher,
            tokenizer,
            policy_version=step,
            top_k=top_k,
            rewards=rewards,
            group_ids=group_ids,
        )
        metrics = opd_update(optimizer, student, prepared, loss, reference=reference)
        metrics["tokens_per_forward"] = trace.tokens_per_forward()
        metrics["cut_without_stop"] = float(1.0 - trace.stopped().mean())
        history.append(metrics)
        ledger = extend_ledger(ledger, step * prompts_per_step, (step + 1) * prompts_per_step)
        done = step + 1
        if eval_every and done % eval_every == 0 and done < phase.steps:
            evaluate(done)
        if done == phase.steps:
            evaluate(done)
        if done % phase.checkpoint_every == 0 or done == end:
            save(done, metrics)
    if checkpointer is not None:
        checkpointer.close()
    return history, reports
