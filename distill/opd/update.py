"""The OPD update step: exact packed replay of a prepared batch under the live student (and
the frozen reference, when the loss has a reference KL), the configured
:class:`~distill.losses.OpdLoss` (or, for a planner rollout, the joint token + commit
decision loss :class:`~distill.opd.planner_loss.JointLoss`) with the trace's ``action_logps`` as behaviour log-probs
(the importance ratio of a stale rollout), and one optimizer update, all in one ``jax.jit``.

``optimizer.microbatches`` splits the rows into slices replayed and differentiated one at
a time; weighted sums and denominators add up and divide once. The reverse-KL advantages
use batch-wide baselines, so they are computed first from a forward-only pass over every
slice; the GRPO task advantages are normalized within prompt groups, which slices keep whole
(the job config requires it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from distill.diffusion.replay import (
    CompletionReplay,
    decision_layout,
    decision_steps,
    num_steps_bucket,
    replay_completion,
)
from distill.losses import OpdLoss, accumulate, reverse_kl_advantages
from distill.models.transformer import Transformer
from distill.opd.batch import PreparedBatch
from distill.opd.planner_loss import JointLoss
from distill.train import row_slice


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


def _joint_terms(
    loss: JointLoss,
    replayed: CompletionReplay,
    prepared: PreparedBatch,
    reference_logps: jax.Array | None,
):
    """The joint loss of a planner batch, every input in completion space."""
    trace, gather = prepared.trace, replayed.gather
    present = replayed.present
    drawn, _ = decision_layout(trace)
    return loss(
        jnp.where(present, gather(prepared.weights), 0.0),
        present=present,
        student_logps=replayed.logps,
        behaviour_logps=gather(trace.action_logps),
        teacher_logps=gather(prepared.teacher_logps),
        token_steps=gather(trace.action_steps),
        decision_logps=replayed.decision_logps,
        behaviour_decision_logps=gather(trace.decision_logps),
        drawn=gather(drawn) & present[..., None],
        decision_steps=gather(decision_steps(trace)),
        reference_logps=reference_logps,
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "reference_graphdef", "loss", "num_chunks", "microbatches"),
    donate_argnums=(1,),
)
def _opd_step(
    graphdef,
    state,
    reference_state,
    prepared: PreparedBatch,
    *,
    reference_graphdef,
    loss: OpdLoss | JointLoss,
    num_chunks: int,
    microbatches: int = 1,
):
    optimizer, model = nnx.merge(graphdef, state)
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    batch = prepared.trace.tokens.shape[0]
    # Full kinds need the student's whole distribution; top-k kinds only its log-probs at
    # the teacher's ids (never [B, N, V]); reverse_kl only the actions'.
    distributions = loss.kind != "reverse_kl" and loss.teacher_top_k is None
    topk = loss.kind != "reverse_kl" and loss.teacher_top_k is not None
    joint = isinstance(loss, JointLoss)

    def piece(index):
        return row_slice(prepared, batch, microbatches, index)

    opd_advantage_values = None
    if microbatches > 1 and loss.kind == "reverse_kl":
        # The advantages' baselines are batch-wide: a forward-only pass over every
        # microbatch gives the live student's log-probs, the advantages are computed once
        # over the whole batch, and each microbatch's gradient pass uses its slice of them.
        def forward(index):
            student = nnx.merge(graph, params, rest)
            replayed = replay_completion(student, piece(index).trace, num_chunks=num_chunks)
            return replayed.logps, replayed.slots, replayed.present

        logps, slots, present = jax.lax.map(forward, jnp.arange(microbatches))
        logps, slots, present = (x.reshape(batch, *x.shape[2:]) for x in (logps, slots, present))

        def gather(values):
            return jnp.take_along_axis(values, slots, axis=1)

        opd_advantage_values = reverse_kl_advantages(
            logps,
            gather(prepared.teacher_logps),
            jnp.where(present, gather(prepared.weights), 0.0),
            gather(prepared.trace.positions),
            advantage=loss.advantage,
        )

    def objective(params, micro: PreparedBatch, micro_advantages):
        student = nnx.merge(graph, params, rest)
        reference_logps = None
        if reference_graphdef is not None:
            reference = nnx.merge(reference_graphdef, reference_state)
            reference_logps = jax.lax.stop_gradient(
                replay_completion(reference, micro.trace, num_chunks=num_chunks).logps
            )
        replayed = replay_completion(
            student,
            micro.trace,
            num_chunks=num_chunks,
            distributions=distributions,
            gather_ids=micro.teacher_topk_ids if topk else None,
            decisions=joint,
        )
        if joint:
            terms = _joint_terms(loss, replayed, micro, reference_logps)
        else:
            weights, inputs = _loss_inputs(loss, replayed, micro, reference_logps)
            if micro_advantages is not None:
                inputs["opd_advantage_values"] = micro_advantages
            terms = loss(weights, **inputs)
        # One microbatch: the ratio; several: the weighted sum, divided once at the end.
        return (terms.value() if microbatches == 1 else terms.total), terms

    gradient = jax.value_and_grad(objective, has_aux=True)
    if microbatches == 1:
        (value, terms), grads = gradient(params, prepared, None)
    else:

        def body(carry, index):
            grads, terms = carry
            micro_advantages = None
            if opd_advantage_values is not None:
                micro_advantages = row_slice(opd_advantage_values, batch, microbatches, index)
            (_, micro_terms), micro_grads = gradient(params, piece(index), micro_advantages)
            grads = jax.tree.map(jnp.add, grads, micro_grads)
            return (grads, accumulate(terms, micro_terms)), None

        # The first microbatch fixes the terms' structure; the rest are scanned.
        first_advantages = None
        if opd_advantage_values is not None:
            first_advantages = row_slice(opd_advantage_values, batch, microbatches, 0)
        (_, terms), grads = gradient(params, piece(0), first_advantages)
        (grads, terms), _ = jax.lax.scan(body, (grads, terms), jnp.arange(1, microbatches))
        denominator = terms.denominator
        grads = jax.tree.map(
            lambda g: jnp.where(denominator > 0, g / jnp.maximum(denominator, 1e-30), 0.0),
            grads,
        )
        value = terms.value()
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
    loss: OpdLoss | JointLoss,
    *,
    reference: Transformer | None = None,
    microbatches: int = 1,
) -> dict[str, float]:
    """One OPD optimizer update of ``model`` (in place) from a prepared batch. ``reference``
    (a frozen student) is required when ``loss.kl_reference_weight > 0``. ``microbatches``
    row slices are replayed and differentiated one at a time (bounding memory), their
    weighted sums and denominators added and divided once: the same update as the whole
    batch, to float32 rounding. The reverse-KL advantages, whose baselines are batch-wide,
    come from a forward-only pass over every slice first. A planner trace
    (``commit_rule: planner``) takes a :class:`JointLoss` and one microbatch."""
    batch = prepared.trace.tokens.shape[0]
    planner = prepared.trace.settings.commit_rule == "planner"
    if planner != isinstance(loss, JointLoss):
        raise ValueError(
            "`loss` must be a JointLoss exactly for a planner trace (commit_rule "
            f"{prepared.trace.settings.commit_rule!r}); received {type(loss).__name__}"
        )
    if planner and microbatches != 1:
        raise ValueError(
            "`microbatches` must be 1 for the planner's joint loss (its step baselines are "
            f"batch-wide); received {microbatches}"
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"`microbatches` must be an int >= 1; received {microbatches!r}")
    if batch % microbatches:
        raise ValueError(
            f"`microbatches` must divide the batch's {batch} rows; received {microbatches}"
        )
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
    # The step donates the state it is given; donate a private copy, so arrays that another
    # holder shares (an `nnx.clone` of the model, a published weight view) stay alive.
    state = jax.tree.map(jnp.copy, state)
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
        microbatches=microbatches,
    )
    nnx.update((optimizer, model), state)
    return {name: float(value) for name, value in metrics.items()}


def frozen_copy(model: Transformer) -> Transformer:
    """An independent copy (fresh buffers: training donates the live model's)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
