"""On-policy distillation (OPD) losses: weighted sums with explicit denominators.

Every loss returns a :class:`LossTerms`: a weighted ``total`` (a SUM over tokens, never a
mean), its ``denominator`` (the sum of ``weights``; model-independent, so a learner can
compute it for the whole batch before any forward) and metrics, each a :class:`Weighted`
``(total, denominator)`` pair (both from :mod:`distill.weighted`, re-exported here).
Gradient accumulation adds totals and denominators over microbatches and hosts and divides
once (:func:`accumulate`, :meth:`LossTerms.value`).
Weights are applied with ``where``, never by multiplication alone, and every input is
sanitized on inactive slots (``weights == 0``) before any arithmetic, so NaN / inf there
cannot leak: a batch with zero total weight gives exactly 0 loss and exactly 0 gradients.

Per-token arrays are ``[B, L]`` over the student's layout; ``weights`` come from
:func:`opd_weights` (1 on completion slots through the first stop token, 0 elsewhere).
Weights must be finite and >= 0 (they are loss weights, not reward scales). Called with
concrete weights, every function raises on a negative or non-finite weight; under ``jit``
such a weight counts as 0 and is counted in the ``invalid_weights`` metric of every
:class:`LossTerms` (a share of the entries), which the caller must treat as an error.

Reverse KL by policy gradient (``loss.kind = "reverse_kl"``, the default)
-------------------------------------------------------------------------
For a student pi and teacher q, ``grad E_{x~pi}[log pi(x) - log q(x)]
= E[grad log pi(x) * (log pi(x) - log q(x))] + E[grad log pi(x)]`` and the last term is 0
(the score has zero mean). So with the stop-gradient advantage
``A = -(log pi - log q) = r`` the surrogate ``-ratio * A`` (``ratio = exp(log pi - log
behaviour)``, 1 on-policy) has exactly this gradient. Per token, ``r_p = log q(x_p) -
log pi(x_p)`` (teacher's and live student's log-prob of the committed token ``x_p``).
Advantages (``loss.advantage``):

- ``token``: ``A_p = r_p``: each token's own log-ratio (the per-token reverse KL with the
  token's context held fixed). Cannot credit a token for what it does to later tokens.
- ``return_to_go``: ``G_p = sum of r_q over weighted q with order_q >= order_p``
  (``order`` = the teacher's left-to-right order, i.e. logical position), minus a baseline.
  The baseline at a token is the batch mean of ``G`` over the rows that have a token at the
  same *rank* (0 = the row's first weighted token, 1 = the second, ...), i.e. the same step
  of the completion; the token's own row is included, so ``A = (n-1)/n * (G - mean of
  the other rows)``, and a rank only one row reaches gets ``A = 0``. Ranks, not logical
  positions, because prompts differ in length. This is exact credit assignment for a
  left-to-right policy; for a block-diffusion student (which commits in denoising order)
  it is a lower-variance heuristic that drops the earlier tokens' log-ratios.
- ``mean_to_go`` (default): ``G_p`` divided by the number of tokens it sums, with the
  same rank baseline. Summed log-ratios favour rows that stop early (fewer negative terms):
  on ``agree`` decoded in one forward, ``return_to_go`` usually collapses the student onto
  an immediate stop token (a local optimum of the summed KL), while ``mean_to_go`` makes
  the letters agree (docs/opd.md has the runs). The price is a length-normalized objective
  rather than the sequence-level reverse KL.
- ``sequence``: ``A_p = R_b - mean_b' R_b'`` with ``R_b`` the row's sum of ``r`` and the
  mean over rows that have any weight: the unbiased sequence-level estimator (every token
  of a row gets the same advantage).

Baselines are batch statistics of the rows passed in (a microbatch, under accumulation)
and carry no gradient. Orders of the weighted tokens of a row must be distinct (they are
when the weights come from :func:`opd_weights`); ties are broken by slot index.
Importance weighting uses the rollout trace's ``action_logps`` as behaviour log-probs;
with ``ppo_clip = eps`` the surrogate is ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) *
A)``, so a ratio outside the band stops the gradient exactly when moving it further would
increase the objective.

Full-vocabulary and top-k divergences (``forward_kl``, ``reverse_kl_full``, ``jsd``)
-------------------------------------------------------------------------------------
``forward_kl = KL(teacher || student)``, ``reverse_kl_full = KL(student || teacher)``,
``jsd = KL(p || m) / 2 + KL(q || m) / 2`` with ``m = (p + q) / 2``, per token, summed over
the vocabulary (``0 log 0 = 0``). With the teacher's top-k the divergence is over the
coarsened distributions: the k ids plus one tail bucket with the remaining mass (teacher:
``1 - sum exp(topk_logps)``; student: ``1 - sum`` of its probabilities at those ids), which
is the exact divergence of the coarsened distributions. Tail masses are clamped to
``[0, 1]`` (rounding can make them slightly negative) and the *logs* of tail masses are
floored at ``log(tail_floor)``: with ``k = V`` both tails are rounding noise below the
floor and the tail term is exactly 0 (top-k with ``k = V`` equals the full divergence),
and a student whose tail underflows gets a large finite, not infinite, forward KL.

These are per-token losses: the OPD update compares the student's distribution at the step
it committed ``x_p`` (its context: the tokens committed at earlier steps) with the causal
teacher's ``q(. | x_<p)``. That target is right only when the two contexts hold the same
information; a student that commits a later token first is taught to ignore it (on
``agree``: to stop copying, so the letters decorrelate). ``reverse_kl`` scores whole
sequences, whose probability is the same in any order, and has no such bias.
``tests/test_losses_known_answer.py`` pins both fixed points; docs/opd.md has the runs.

Task reward (GRPO)
------------------
:func:`grpo_advantages` normalizes rewards within groups; :func:`task_advantages` broadcasts
them to the weighted tokens, scaled by ``loss.task_reward_weight``; they are added to the
OPD advantage (``reverse_kl``) or trained with their own policy-gradient term (the
full-vocabulary kinds). :func:`k3_kl` is the k3 estimator of KL(student || reference),
added with ``loss.kl_reference_weight``. :class:`OpdLoss` puts it all together from a
:class:`~distill.config.LossConfig`.

Teacher values are stop-gradient and must be finite on weighted tokens (the full /
top-k log-probs may be -inf, a zero probability, but never NaN or +inf). Called eagerly,
the functions raise on a violation; under ``jit`` the offending tokens contribute nothing
and are counted in the ``teacher_nonfinite`` metric, which the caller must treat as an
error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from distill.config import LossConfig
from distill.weighted import (
    LossTerms,
    Weighted,
    accumulate,
    check_weights,
    f32_sum,
    invalid_weights,
    safe_ratio,
)

LOSS_KINDS = ("reverse_kl", "forward_kl", "reverse_kl_full", "jsd")
DIVERGENCE_KINDS = ("forward_kl", "reverse_kl_full", "jsd")
ADVANTAGES = ("token", "return_to_go", "mean_to_go", "sequence")
DEFAULT_TAIL_FLOOR = 1e-6

_INT_MAX = int(np.iinfo(np.int32).max)


# ---- denominators --------------------------------------------------------------------------


def denominator(weights: jax.Array) -> jax.Array:
    """The denominator every OPD loss uses: the sum of ``weights`` (float32; invalid
    weights, refused when concrete, count as 0)."""
    check_weights("weights", weights)
    weights = jnp.asarray(weights)
    valid = (weights > 0) & jnp.isfinite(weights)
    return jnp.sum(jnp.where(valid, weights, 0.0), dtype=jnp.float32)


# ---- validation ---------------------------------------------------------------------------


def _error(field: str, requirement: str, received: Any) -> ValueError:
    return ValueError(f"`{field}` must {requirement}; received {received!r}")


def _check_rank(name: str, array: Any, rank: int, what: str) -> None:
    if jnp.ndim(array) != rank:
        raise _error(name, f"have rank {rank} ({what})", tuple(jnp.shape(array)))


def _check_shape(name: str, array: Any, shape: tuple[int, ...], like: str) -> None:
    """``array`` (or a shape tuple) must have ``shape``; ``like`` says where it comes from."""
    got = array if isinstance(array, tuple) else tuple(jnp.shape(array))
    if got != tuple(shape):
        raise _error(name, f"have shape {tuple(shape)} to match {like}", got)


def _weights_shape(weights: Any) -> tuple[int, ...]:
    _check_rank("weights", weights, 2, "[B, L]")
    return tuple(jnp.shape(weights))


def _weights(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(active, weights)``: float32 weights, 0 wherever inactive. Negative or non-finite
    weights are refused when concrete; traced, they are inactive (see :func:`_invalid`)."""
    _check_rank("weights", weights, 2, "[B, L]")
    check_weights("weights", weights)
    weights = jnp.asarray(weights)
    # +inf too: it would turn the loss into NaN (inf * 0 or inf / inf).
    active = (weights > 0) & jnp.isfinite(weights)
    return active, jnp.where(active, weights, 0.0).astype(jnp.float32)


def _invalid(weights: jax.Array) -> Weighted:
    """The ``invalid_weights`` metric: negative or non-finite weights over all entries."""
    weights = jnp.asarray(weights)
    return Weighted(jnp.sum(invalid_weights(weights), dtype=jnp.float32), jnp.float32(weights.size))


def _is_concrete(*arrays: Any) -> bool:
    return not any(isinstance(array, jax.core.Tracer) for array in arrays)


def _raise_if_nonfinite(name: str, bad: jax.Array, requirement: str) -> None:
    """Eagerly (outside any trace) raise if ``bad`` has any True entry."""
    if not _is_concrete(bad):
        return
    bad = np.asarray(bad)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise _error(name, requirement, f"{int(bad.sum())} bad value(s), first at {first}")


def _mean_metric(values: jax.Array, weights: jax.Array, active: jax.Array) -> Weighted:
    return Weighted(f32_sum(values * weights, active), f32_sum(weights, active))


# ---- OPD weights ---------------------------------------------------------------------------


class OpdWeights(NamedTuple):
    """``weights [B, L]`` float32, ``teacher_visible [B, L]`` bool, ``invalid_rows [B]``."""

    weights: jax.Array
    teacher_visible: jax.Array
    invalid_rows: jax.Array


def opd_weights(
    tokens: jax.Array,
    completion_mask: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    stop_ids: Sequence[int] | jax.Array = (),
) -> OpdWeights:
    """OPD loss weights and the teacher's view of each row.

    Valid slots are ``segment_ids != 0`` (never token values). Weight 1 on completion slots
    whose logical position is at most the first stop token's (the stop token is trained),
    0 elsewhere. ``teacher_visible``: valid slots up to that position (prompt + completion
    through the first stop); nothing after the stop is scored. Without a stop token the
    whole completion is weighted and visible.

    A row is invalid (all-zero weights, nothing visible, flagged in ``invalid_rows``) when:
    its valid slots span more than one segment; a completion slot is padding; it has no
    prompt or no completion; its positions are not a permutation of ``0..n-1`` over its
    ``n`` valid slots; or its completion is not one contiguous suffix in logical order (a
    prompt token after a completion token, or a gap in the completion).
    """
    tokens = jnp.asarray(tokens)
    _check_rank("tokens", tokens, 2, "[B, L]")
    shape = tokens.shape
    for name, array in (
        ("completion_mask", completion_mask),
        ("positions", positions),
        ("segment_ids", segment_ids),
    ):
        _check_shape(name, jnp.asarray(array), shape, "`tokens`")
    stops = jnp.asarray(stop_ids, dtype=jnp.int32).reshape(-1)
    length = shape[1]

    segment_ids = jnp.asarray(segment_ids)
    positions = jnp.asarray(positions).astype(jnp.int32)
    valid = segment_ids != 0
    completion = jnp.asarray(completion_mask, bool)
    prompt = valid & ~completion
    count = jnp.sum(valid, axis=1)

    low_segment = jnp.min(jnp.where(valid, segment_ids, jnp.iinfo(segment_ids.dtype).max), 1)
    high_segment = jnp.max(jnp.where(valid, segment_ids, jnp.iinfo(segment_ids.dtype).min), 1)
    one_segment = low_segment == high_segment
    completion_valid = ~jnp.any(completion & ~valid, axis=1)
    has_prompt = jnp.any(prompt, axis=1)
    has_completion = jnp.any(completion & valid, axis=1)
    # Positions over valid slots, sorted, must read 0, 1, ..., n-1.
    ranked = jnp.sort(jnp.where(valid, positions, _INT_MAX), axis=1)
    slots = jnp.arange(length, dtype=jnp.int32)[None, :]
    permutation = jnp.all((slots >= count[:, None]) | (ranked == slots), axis=1)
    last_prompt = jnp.max(jnp.where(prompt, positions, -1), axis=1)
    first_completion = jnp.min(jnp.where(completion & valid, positions, _INT_MAX), axis=1)
    last_completion = jnp.max(jnp.where(completion & valid, positions, -1), axis=1)
    completion_count = jnp.sum(completion & valid, axis=1)
    contiguous = (last_completion - first_completion + 1 == completion_count) & (
        last_prompt < first_completion
    )
    ok = one_segment & completion_valid & has_prompt & has_completion & permutation & contiguous

    is_stop = jnp.any(tokens[..., None] == stops, axis=-1)  # False when there are no stops
    first_stop = jnp.min(jnp.where(completion & valid & is_stop, positions, _INT_MAX), axis=1)
    upto_stop = positions <= first_stop[:, None]
    visible = valid & upto_stop & ok[:, None]
    weights = jnp.where(visible & completion, 1.0, 0.0).astype(jnp.float32)
    return OpdWeights(weights, visible, ~ok)


# ---- policy gradient -----------------------------------------------------------------------


def _check_ppo_clip(ppo_clip: float | None, field: str = "ppo_clip") -> None:
    if ppo_clip is None:
        return
    if isinstance(ppo_clip, bool) or not isinstance(ppo_clip, int | float):
        raise _error(field, "be a number > 0 or None", ppo_clip)
    if not (math.isfinite(ppo_clip) and ppo_clip > 0):
        raise _error(field, "be > 0 or None", ppo_clip)


def policy_gradient(
    student_logps: jax.Array,
    behaviour_logps: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    *,
    ppo_clip: float | None = None,
) -> LossTerms:
    """Importance-weighted (optionally PPO-clipped) policy-gradient surrogate.

    ``ratio = exp(student_logps - behaviour_logps)``; per token ``-ratio * A`` or, with
    ``ppo_clip = eps``, ``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)``; ``A`` (the
    ``advantages``) and the behaviour log-probs carry no gradient. Metrics: ``ratio`` (mean
    ratio), ``clip_fraction`` (share of weight whose gradient is clipped), ``advantage``.
    """
    shape = _weights_shape(weights)
    _check_shape("student_logps", student_logps, shape, "`weights`")
    _check_shape("behaviour_logps", behaviour_logps, shape, "`weights`")
    _check_shape("advantages", advantages, shape, "`weights`")
    _check_ppo_clip(ppo_clip)
    invalid = _invalid(weights)
    active, weights = _weights(weights)
    student = jnp.where(active, student_logps, 0.0)
    behaviour = jax.lax.stop_gradient(jnp.where(active, behaviour_logps, 0.0))
    advantage = jax.lax.stop_gradient(jnp.where(active, advantages, 0.0))
    ratio = jnp.exp(student - behaviour)
    unclipped = ratio * advantage
    if ppo_clip is None:
        surrogate = -unclipped
        clipped = jnp.zeros(shape, bool)
    else:
        low, high = 1.0 - ppo_clip, 1.0 + ppo_clip
        surrogate = -jnp.minimum(unclipped, jnp.clip(ratio, low, high) * advantage)
        clipped = ((advantage > 0) & (ratio > high)) | ((advantage < 0) & (ratio < low))
    frozen_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "ratio": _mean_metric(frozen_ratio, weights, active),
        "clip_fraction": _mean_metric(clipped.astype(jnp.float32), weights, active),
        "advantage": _mean_metric(advantage, weights, active),
        "invalid_weights": invalid,
    }
    return LossTerms(f32_sum(surrogate * weights, active), f32_sum(weights, active), metrics)


def _return_to_go(
    log_ratio: jax.Array, active: jax.Array, order: jax.Array, *, mean: bool = False
) -> jax.Array:
    """Return-to-go in ``order`` (``mean``: divided by the number of tokens it sums) minus
    the batch mean at the same rank (see module doc)."""
    key = jnp.where(active, order.astype(jnp.int32), _INT_MAX)
    permutation = jnp.argsort(key, axis=1, stable=True)
    ranked = jnp.take_along_axis(log_ratio, permutation, axis=1)
    ranked_active = jnp.take_along_axis(active, permutation, axis=1)
    returns = jnp.flip(jnp.cumsum(jnp.flip(ranked, axis=1), axis=1), axis=1)
    if mean:
        remaining = jnp.flip(jnp.cumsum(jnp.flip(ranked_active, axis=1), axis=1), axis=1)
        returns = safe_ratio(returns, remaining.astype(jnp.float32))
    present = jnp.sum(ranked_active, axis=0, dtype=jnp.float32)
    baseline = safe_ratio(jnp.sum(jnp.where(ranked_active, returns, 0.0), axis=0), present)
    ranked_advantage = jnp.where(ranked_active, returns - baseline[None, :], 0.0)
    inverse = jnp.argsort(permutation, axis=1)
    return jnp.take_along_axis(ranked_advantage, inverse, axis=1)


def opd_advantages(
    log_ratio: jax.Array,
    weights: jax.Array,
    order: jax.Array | None = None,
    *,
    advantage: str = "return_to_go",
) -> jax.Array:
    """``[B, L]`` advantages from per-token log-ratios ``r = log q - log pi`` (stop-gradient;
    0 off the weighted tokens). ``order`` (logical positions) is needed for
    ``return_to_go``. See the module docstring for the three kinds and their baselines."""
    if advantage not in ADVANTAGES:
        raise _error("advantage", f"be one of {ADVANTAGES}", advantage)
    shape = _weights_shape(weights)
    _check_shape("log_ratio", log_ratio, shape, "`weights`")
    if advantage in ("return_to_go", "mean_to_go"):
        if order is None:
            raise _error("order", "be given (logical positions) for advantage 'return_to_go'", None)
        _check_shape("order", order, shape, "`weights`")
    active, weights = _weights(weights)
    r = jax.lax.stop_gradient(jnp.where(active, log_ratio, 0.0)).astype(jnp.float32)
    if advantage == "token":
        return r
    if advantage == "sequence":
        rows = jnp.any(active, axis=1)
        totals = jnp.sum(r, axis=1)
        baseline = safe_ratio(
            jnp.sum(jnp.where(rows, totals, 0.0)), jnp.sum(rows, dtype=jnp.float32)
        )
        return jnp.where(active, (totals - baseline)[:, None], 0.0)
    return _return_to_go(r, active, jnp.asarray(order), mean=advantage == "mean_to_go")


def reverse_kl_advantages(
    student_logps: jax.Array,
    teacher_logps: jax.Array,
    weights: jax.Array,
    order: jax.Array | None = None,
    *,
    advantage: str = "return_to_go",
) -> jax.Array:
    """The OPD advantages :func:`reverse_kl` computes, as ``[B, L]`` (stop-gradient): for
    microbatch accumulation, computed once over the whole batch (their baselines are
    batch-wide) and passed to each microbatch's :func:`reverse_kl`."""
    active, weights = _weights(weights)
    scored = active & jnp.isfinite(teacher_logps)
    student = jax.lax.stop_gradient(jnp.where(active, student_logps, 0.0))
    teacher = jax.lax.stop_gradient(jnp.where(scored, teacher_logps, 0.0))
    log_ratio = jnp.where(scored, teacher - student, 0.0)
    return opd_advantages(log_ratio, weights, order, advantage=advantage)


def reverse_kl(
    student_logps: jax.Array,
    behaviour_logps: jax.Array,
    teacher_logps: jax.Array,
    weights: jax.Array,
    order: jax.Array | None = None,
    *,
    advantage: str = "return_to_go",
    ppo_clip: float | None = None,
    extra_advantages: jax.Array | None = None,
    opd_advantage_values: jax.Array | None = None,
) -> LossTerms:
    """The default OPD loss: reverse KL(student || teacher) by policy gradient.

    ``opd_advantage_values`` ``[B, L]``: the OPD advantages computed beforehand over a
    larger batch (:func:`reverse_kl_advantages`; microbatch accumulation), used instead of
    computing them from these rows alone.

    ``student_logps [B, L]``: live student's log-prob of the committed token (exact replay;
    differentiable). ``behaviour_logps``: the trace's ``action_logps``. ``teacher_logps``:
    the teacher's log-prob of the same token (finite on weighted tokens). ``order``: logical
    positions (for ``return_to_go``). ``extra_advantages`` ``[B, L]`` or ``[B]`` (e.g.
    :func:`task_advantages`) is added to the OPD advantage before the surrogate.

    Metrics: ``reverse_kl`` (per-token estimate ``log pi - log q`` on the sampled tokens),
    ``ratio``, ``clip_fraction``, ``advantage``, ``teacher_nonfinite``.
    """
    shape = _weights_shape(weights)
    _check_shape("student_logps", student_logps, shape, "`weights`")
    _check_shape("behaviour_logps", behaviour_logps, shape, "`weights`")
    _check_shape("teacher_logps", teacher_logps, shape, "`weights`")
    if extra_advantages is not None and jnp.ndim(extra_advantages) == 1:
        _check_shape("extra_advantages", extra_advantages, shape[:1], "the rows of `weights`")
    elif extra_advantages is not None:
        _check_shape("extra_advantages", extra_advantages, shape, "`weights`")
    if advantage not in ADVANTAGES:
        raise _error("advantage", f"be one of {ADVANTAGES}", advantage)
    if advantage in ("return_to_go", "mean_to_go") and order is None:
        raise _error("order", "be given (logical positions) for advantage 'return_to_go'", None)
    _check_ppo_clip(ppo_clip)
    invalid = _invalid(weights)
    active, weights = _weights(weights)
    finite = jnp.isfinite(teacher_logps)
    _raise_if_nonfinite("teacher_logps", active & ~finite, "be finite where `weights` > 0")
    scored = active & finite
    student = jnp.where(active, student_logps, 0.0)
    teacher = jax.lax.stop_gradient(jnp.where(scored, teacher_logps, 0.0))
    frozen_student = jax.lax.stop_gradient(student)
    log_ratio = jnp.where(scored, teacher - frozen_student, 0.0)
    if opd_advantage_values is None:
        advantages = opd_advantages(log_ratio, weights, order, advantage=advantage)
    else:
        _check_shape("opd_advantage_values", opd_advantage_values, shape, "`weights`")
        advantages = jnp.where(active, jax.lax.stop_gradient(opd_advantage_values), 0.0)
    if extra_advantages is not None:
        extra = jnp.asarray(extra_advantages)
        if extra.ndim == 1:
            extra = jnp.broadcast_to(extra[:, None], shape)
        advantages = advantages + jnp.where(active, extra, 0.0)
    terms = policy_gradient(student_logps, behaviour_logps, advantages, weights, ppo_clip=ppo_clip)
    metrics = dict(terms.metrics)
    metrics["reverse_kl"] = _mean_metric(-log_ratio, weights, scored)
    metrics["teacher_nonfinite"] = Weighted(
        jnp.sum(active & ~finite, dtype=jnp.float32), jnp.sum(active, dtype=jnp.float32)
    )
    # The policy gradient saw the sanitized weights; count the caller's.
    metrics["invalid_weights"] = invalid
    return LossTerms(terms.total, terms.denominator, metrics)


# ---- full-vocabulary and top-k divergences ------------------------------------------------


def _bucket_divergence(
    kind: str,
    p_mass: jax.Array,
    p_log: jax.Array,
    q_mass: jax.Array,
    q_log: jax.Array,
    m_log: jax.Array | None,
) -> jax.Array:
    """Divergence between teacher ``p`` and student ``q`` over the last axis (buckets).

    Masses are >= 0; a log must be finite where its mass is > 0 and may be -inf elsewhere.
    Every log is re-selected under the term's own mask before use, so the unselected branch
    of each ``where`` holds no inf and no NaN reaches a gradient."""
    p_pos, q_pos = p_mass > 0, q_mass > 0

    def kl(mass, log, pos, other_log):
        gap = jnp.where(pos, log, 0.0) - jnp.where(pos, other_log, 0.0)
        return jnp.sum(jnp.where(pos, mass * gap, 0.0), axis=-1)

    if kind == "forward_kl":
        return kl(p_mass, p_log, p_pos, q_log)
    if kind == "reverse_kl_full":
        return kl(q_mass, q_log, q_pos, p_log)
    return 0.5 * kl(p_mass, p_log, p_pos, m_log) + 0.5 * kl(q_mass, q_log, q_pos, m_log)


def _entries(log_probs: jax.Array) -> jax.Array:
    """Masses of normalized log-probs; -inf (and NaN) entries get mass 0 (no inf inside)."""
    positive = log_probs > -jnp.inf
    return jnp.where(positive, jnp.exp(jnp.where(positive, log_probs, 0.0)), 0.0)


def _mixture_log(p_log_probs: jax.Array, q_log_probs: jax.Array) -> jax.Array:
    """``log((p + q) / 2)`` entrywise; finite wherever p or q is positive, 0 where neither."""
    p_pos, q_pos = p_log_probs > -jnp.inf, q_log_probs > -jnp.inf
    either = p_pos | q_pos
    absent = jnp.where(either, -jnp.inf, 0.0)
    p = jnp.where(p_pos, p_log_probs, absent)
    q = jnp.where(q_pos, q_log_probs, absent)
    return jnp.where(either, jnp.logaddexp(p, q) - math.log(2.0), 0.0)


def _entry_divergence(kind: str, teacher: jax.Array, student: jax.Array) -> jax.Array:
    # The logs stay raw: a student -inf where the teacher has mass is a genuine infinity.
    m_log = _mixture_log(teacher, student) if kind == "jsd" else None
    return _bucket_divergence(kind, _entries(teacher), teacher, _entries(student), student, m_log)


def _tail(log_probs: jax.Array, floor: float) -> tuple[jax.Array, jax.Array]:
    """Mass ``1 - sum exp(log_probs)`` over the last axis (clamped to [0, 1]) and its log
    floored at ``log(floor)``; ``[..., 1]`` each."""
    present = log_probs > -jnp.inf
    some = jnp.any(present, axis=-1, keepdims=True)
    # All entries -inf: keep logsumexp's input finite (its gradient would be NaN); mass 1.
    safe = jnp.where(some, jnp.where(present, log_probs, -jnp.inf), 0.0)
    kept = jnp.where(some[..., 0], jnp.minimum(jax.nn.logsumexp(safe, axis=-1), 0.0), -jnp.inf)
    mass = jnp.clip(-jnp.expm1(kept), 0.0, 1.0)[..., None]
    return mass, jnp.log(jnp.maximum(mass, floor))


def _check_kind(kind: str, kinds: tuple[str, ...], field: str = "kind") -> None:
    if kind not in kinds:
        raise _error(field, f"be one of {kinds}", kind)


def _teacher_rows(name: str, teacher: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scored, bad)`` per token: a teacher row is bad when any entry is NaN or +inf."""
    bad = active & jnp.any(jnp.isnan(teacher) | (teacher == jnp.inf), axis=-1)
    _raise_if_nonfinite(name, bad, "be finite or -inf (no NaN / +inf) where `weights` > 0")
    return active & ~bad, bad


def _divergence_terms(
    kind: str,
    per_token: jax.Array,
    weights: jax.Array,
    active: jax.Array,
    bad: jax.Array,
    invalid: Weighted,
) -> LossTerms:
    scored = active & ~bad
    total = f32_sum(per_token * weights, scored)
    metrics = {
        kind: Weighted(total, f32_sum(weights, scored)),
        "teacher_nonfinite": Weighted(
            jnp.sum(bad, dtype=jnp.float32), jnp.sum(active, dtype=jnp.float32)
        ),
        "invalid_weights": invalid,
    }
    return LossTerms(total, f32_sum(weights, active), metrics)


def divergence(
    kind: str, student_log_probs: jax.Array, teacher_log_probs: jax.Array, weights: jax.Array
) -> LossTerms:
    """Full-vocabulary ``forward_kl`` / ``reverse_kl_full`` / ``jsd`` per token, weighted.

    ``student_log_probs``, ``teacher_log_probs`` ``[B, L, V]``: normalized log-probs (the
    mask id -inf in both). The teacher is stop-gradient. Metric ``<kind>``: the mean
    divergence over scored tokens."""
    _check_kind(kind, DIVERGENCE_KINDS)
    shape = _weights_shape(weights)
    _check_rank("student_log_probs", student_log_probs, 3, "[B, L, V]")
    full = tuple(jnp.shape(student_log_probs))
    _check_shape("student_log_probs", full[:2], shape, "`weights`")
    _check_shape("teacher_log_probs", teacher_log_probs, full, "`student_log_probs`")
    invalid = _invalid(weights)
    active, weights = _weights(weights)
    scored, bad = _teacher_rows("teacher_log_probs", teacher_log_probs, active)
    student = jnp.where(active[..., None], student_log_probs, 0.0)
    teacher = jax.lax.stop_gradient(jnp.where(scored[..., None], teacher_log_probs, 0.0))
    per_token = _entry_divergence(kind, teacher, student)
    return _divergence_terms(kind, per_token, weights, active, bad, invalid)


def gather_topk(student_log_probs: jax.Array, teacher_topk_ids: jax.Array) -> jax.Array:
    """The student's log-probs ``[B, L, k]`` at the teacher's top-k ids."""
    _check_rank("student_log_probs", student_log_probs, 3, "[B, L, V]")
    _check_rank("teacher_topk_ids", teacher_topk_ids, 3, "[B, L, k]")
    _check_shape(
        "teacher_topk_ids", teacher_topk_ids.shape[:2], student_log_probs.shape[:2], "student"
    )
    if teacher_topk_ids.shape[-1] > student_log_probs.shape[-1]:
        raise _error(
            "teacher_topk_ids",
            f"have k <= the vocabulary size {student_log_probs.shape[-1]}",
            teacher_topk_ids.shape,
        )
    return jnp.take_along_axis(student_log_probs, teacher_topk_ids.astype(jnp.int32), axis=-1)


def topk_divergence(
    kind: str,
    student_topk_logps: jax.Array,
    teacher_topk_logps: jax.Array,
    weights: jax.Array,
    *,
    tail_floor: float = DEFAULT_TAIL_FLOOR,
) -> LossTerms:
    """``forward_kl`` / ``reverse_kl_full`` / ``jsd`` over the teacher's top-k ids plus one
    tail bucket (see the module docstring).

    ``student_topk_logps [B, L, k]``: the student's normalized log-probs at the teacher's
    top-k ids (:func:`gather_topk`), differentiable. ``teacher_topk_logps [B, L, k]``: the
    teacher's log-probs there (stop-gradient). The ids must be distinct within a token."""
    _check_kind(kind, DIVERGENCE_KINDS)
    if not (isinstance(tail_floor, int | float) and 0.0 < tail_floor < 1.0):
        raise _error("tail_floor", "be in (0, 1)", tail_floor)
    shape = _weights_shape(weights)
    _check_rank("student_topk_logps", student_topk_logps, 3, "[B, L, k]")
    topk = tuple(jnp.shape(student_topk_logps))
    _check_shape("student_topk_logps", topk[:2], shape, "`weights`")
    _check_shape("teacher_topk_logps", teacher_topk_logps, topk, "`student_topk_logps`")
    invalid = _invalid(weights)
    active, weights = _weights(weights)
    scored, bad = _teacher_rows("teacher_topk_logps", teacher_topk_logps, active)
    student = jnp.where(active[..., None], student_topk_logps, 0.0)
    teacher = jax.lax.stop_gradient(jnp.where(scored[..., None], teacher_topk_logps, 0.0))
    # A sanitized inactive row (all zeros) has mass > 1; its tail clamps to 0.
    head = _entry_divergence(kind, teacher, student)
    p_tail, p_tail_log = _tail(teacher, tail_floor)
    q_tail, q_tail_log = _tail(student, tail_floor)
    m_tail_log = jnp.log(jnp.maximum(0.5 * (p_tail + q_tail), tail_floor))
    tail = _bucket_divergence(kind, p_tail, p_tail_log, q_tail, q_tail_log, m_tail_log)
    return _divergence_terms(kind, head + tail, weights, active, bad, invalid)


# ---- task reward (GRPO) and the reference KL ------------------------------------------------


def grpo_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    *,
    row_mask: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """Group-normalized rewards ``[B]``: ``(r - group mean) / (group std + eps)``.

    Groups are rows sharing a ``group_ids`` value (e.g. completions of one prompt), among
    rows with ``row_mask`` (default: all). The std is the population std (ddof 0). Rows
    outside ``row_mask``, in a group of one, or in a group whose rewards are all equal get
    exactly 0. No gradient."""
    _check_rank("rewards", rewards, 1, "[B]")
    rows = tuple(jnp.shape(rewards))
    _check_shape("group_ids", group_ids, rows, "`rewards`")
    if row_mask is not None:
        _check_shape("row_mask", row_mask, rows, "`rewards`")
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    row_mask = jnp.ones(rows, bool) if row_mask is None else jnp.asarray(row_mask, bool)
    rewards = jnp.where(row_mask, rewards, 0.0)
    same = (group_ids[:, None] == group_ids[None, :]) & row_mask[:, None] & row_mask[None, :]
    count = jnp.sum(same, axis=1, dtype=jnp.float32)
    others = jnp.broadcast_to(rewards[None, :], same.shape)
    mean = safe_ratio(jnp.sum(jnp.where(same, others, 0.0), axis=1), count)
    spread = jnp.where(same, others - mean[:, None], 0.0)
    std = jnp.sqrt(safe_ratio(jnp.sum(spread * spread, axis=1), count))
    high = jnp.max(jnp.where(same, others, -jnp.inf), axis=1)
    low = jnp.min(jnp.where(same, others, jnp.inf), axis=1)
    keep = row_mask & (count >= 2) & (high > low)
    return jax.lax.stop_gradient(jnp.where(keep, (rewards - mean) / (std + eps), 0.0))


def task_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    weights: jax.Array,
    *,
    scale: float = 1.0,
) -> jax.Array:
    """``[B, L]``: ``scale * grpo_advantages`` broadcast to each row's weighted tokens.
    Rows without weight (e.g. invalid rows) are left out of the group statistics."""
    shape = _weights_shape(weights)
    _check_rank("rewards", rewards, 1, "[B]")
    _check_shape("rewards", rewards, shape[:1], "the rows of `weights`")
    active, weights = _weights(weights)
    rows = jnp.any(active, axis=1)
    advantage = grpo_advantages(rewards, group_ids, row_mask=rows)
    return jnp.where(active, scale * advantage[:, None], 0.0)


def k3_kl(student_logps: jax.Array, reference_logps: jax.Array, weights: jax.Array) -> LossTerms:
    """k3 estimator of KL(student || reference) on the sampled tokens:
    ``exp(d) - d - 1 >= 0`` with ``d = reference - student`` (computed as ``expm1(d) - d``);
    differentiable in ``student_logps``, the reference is stop-gradient. Metric ``k3``."""
    shape = _weights_shape(weights)
    _check_shape("student_logps", student_logps, shape, "`weights`")
    _check_shape("reference_logps", reference_logps, shape, "`weights`")
    invalid = _invalid(weights)
    active, weights = _weights(weights)
    student = jnp.where(active, student_logps, 0.0)
    reference = jax.lax.stop_gradient(jnp.where(active, reference_logps, 0.0))
    gap = reference - student
    k3 = jnp.maximum(jnp.expm1(gap) - gap, 0.0)
    total = f32_sum(k3 * weights, active)
    den = f32_sum(weights, active)
    metrics = {"k3": Weighted(jax.lax.stop_gradient(total), den), "invalid_weights": invalid}
    return LossTerms(total, den, metrics)


# ---- dispatcher ----------------------------------------------------------------------------

_INPUTS = (
    "student_logps",
    "behaviour_logps",
    "teacher_logps",
    "order",
    "student_log_probs",
    "teacher_log_probs",
    "student_topk_logps",
    "teacher_topk_ids",
    "teacher_topk_logps",
    "rewards",
    "group_ids",
    "reference_logps",
    "opd_advantage_values",
)


@dataclasses.dataclass(frozen=True)
class OpdLoss:
    """The configured OPD loss (hashable: usable as a static jit argument).

    Call it with ``weights`` and the inputs its :meth:`required_inputs` names (keywords):

    - ``reverse_kl``: ``student_logps``, ``behaviour_logps``, ``teacher_logps``, plus
      ``order`` for ``return_to_go``;
    - ``forward_kl`` / ``reverse_kl_full`` / ``jsd``: ``student_log_probs`` and
      ``teacher_log_probs`` ``[B, L, V]``; with ``teacher_top_k``, ``teacher_topk_ids`` and
      ``teacher_topk_logps`` ``[B, L, k]`` plus ``student_log_probs`` (gathered here) or
      ``student_topk_logps`` (gathered by the caller); ``teacher_top_k`` only affects these
      kinds (``reverse_kl`` needs the teacher's log-prob of the sampled token alone);
    - ``task_reward_weight > 0``: ``rewards`` and ``group_ids`` ``[B]`` (the full kinds also
      need ``student_logps`` and ``behaviour_logps`` for the task policy gradient);
    - ``kl_reference_weight > 0``: ``student_logps`` and ``reference_logps``.

    Every term shares the denominator ``sum(weights)``; the total is
    ``main + task policy gradient (full kinds) + kl_reference_weight * k3``. Inputs that the
    configuration does not use are ignored, except that giving the full teacher
    distribution to a top-k loss (or top-k to a full one) is an error.
    """

    kind: str = "reverse_kl"
    advantage: str = "mean_to_go"
    ppo_clip: float | None = None
    teacher_top_k: int | None = None
    task_reward_weight: float = 0.0
    kl_reference_weight: float = 0.0
    tail_floor: float = DEFAULT_TAIL_FLOOR

    def __post_init__(self) -> None:
        _check_kind(self.kind, LOSS_KINDS, "loss.kind")
        _check_kind(self.advantage, ADVANTAGES, "loss.advantage")
        _check_ppo_clip(self.ppo_clip, "loss.ppo_clip")
        top_k = self.teacher_top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise _error("loss.teacher_top_k", "be a positive integer or None", top_k)
        if top_k is not None and top_k <= 0:
            raise _error("loss.teacher_top_k", "be > 0 or None", top_k)
        for field in ("task_reward_weight", "kl_reference_weight"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _error(f"loss.{field}", "be a number >= 0", value)
            if not (math.isfinite(value) and value >= 0):
                raise _error(f"loss.{field}", "be >= 0", value)
        if not (isinstance(self.tail_floor, int | float) and 0.0 < self.tail_floor < 1.0):
            raise _error("loss.tail_floor", "be in (0, 1)", self.tail_floor)

    @classmethod
    def from_config(cls, config: LossConfig, *, tail_floor: float = DEFAULT_TAIL_FLOOR) -> OpdLoss:
        return cls(
            kind=config.kind,
            advantage=config.advantage,
            ppo_clip=config.ppo_clip,
            teacher_top_k=config.teacher_top_k,
            task_reward_weight=config.task_reward_weight,
            kl_reference_weight=config.kl_reference_weight,
            tail_floor=tail_floor,
        )

    def required_inputs(self) -> tuple[str, ...]:
        """Names (besides ``weights``) a call must give; for top-k the student is given as
        either ``student_log_probs`` or ``student_topk_logps`` (listed as the former)."""
        names: list[str] = []
        if self.kind == "reverse_kl":
            names += ["student_logps", "behaviour_logps", "teacher_logps"]
            if self.advantage in ("return_to_go", "mean_to_go"):
                names.append("order")
        elif self.teacher_top_k is None:
            names += ["student_log_probs", "teacher_log_probs"]
        else:
            names += ["student_log_probs", "teacher_topk_ids", "teacher_topk_logps"]
        if self.task_reward_weight > 0:
            names += ["student_logps", "behaviour_logps", "rewards", "group_ids"]
        if self.kl_reference_weight > 0:
            names += ["student_logps", "reference_logps"]
        return tuple(dict.fromkeys(names))

    def _inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        for name in inputs:
            if name not in _INPUTS:
                raise _error(name, f"not be given (not a loss input; known: {_INPUTS})", name)
        given = {name: value for name, value in inputs.items() if value is not None}
        topk = self.kind != "reverse_kl" and self.teacher_top_k is not None
        for name in self.required_inputs():
            if name == "student_log_probs" and topk and "student_topk_logps" in given:
                continue
            if name not in given:
                raise ValueError(
                    f"`{name}` must be given for loss.kind={self.kind!r} "
                    f"(advantage={self.advantage!r}, teacher_top_k={self.teacher_top_k}, "
                    f"task_reward_weight={self.task_reward_weight}, "
                    f"kl_reference_weight={self.kl_reference_weight}); it is missing"
                )
        if self.kind != "reverse_kl":
            conflict = ("teacher_topk_ids", "teacher_topk_logps") if not topk else ()
            conflict += ("teacher_log_probs",) if topk else ()
            for name in conflict:
                if name in given:
                    raise _error(
                        name,
                        f"not be given when loss.teacher_top_k={self.teacher_top_k} "
                        "(the teacher's output form must match the configuration)",
                        getattr(given[name], "shape", given[name]),
                    )
        return given

    def __call__(self, weights: jax.Array, **inputs: Any) -> LossTerms:
        weights = jnp.asarray(weights)
        _check_rank("weights", weights, 2, "[B, L]")
        given = self._inputs(inputs)
        task = None
        if self.task_reward_weight > 0:
            task = task_advantages(
                given["rewards"], given["group_ids"], weights, scale=self.task_reward_weight
            )
        if self.kind == "reverse_kl":
            terms = reverse_kl(
                given["student_logps"],
                given["behaviour_logps"],
                given["teacher_logps"],
                weights,
                given.get("order"),
                advantage=self.advantage,
                ppo_clip=self.ppo_clip,
                extra_advantages=task,
                opd_advantage_values=given.get("opd_advantage_values"),
            )
        else:
            terms = self._divergence(weights, given)
            if task is not None:
                extra = policy_gradient(
                    given["student_logps"],
                    given["behaviour_logps"],
                    task,
                    weights,
                    ppo_clip=self.ppo_clip,
                )
                metrics = terms.metrics | {f"task_{k}": v for k, v in extra.metrics.items()}
                terms = LossTerms(terms.total + extra.total, terms.denominator, metrics)
        if self.kl_reference_weight > 0:
            k3 = k3_kl(given["student_logps"], given["reference_logps"], weights)
            metrics = terms.metrics | {"kl_reference": k3.metrics["k3"]}
            total = terms.total + self.kl_reference_weight * k3.total
            terms = LossTerms(total, terms.denominator, metrics)
        return terms

    def _divergence(self, weights: jax.Array, given: Mapping[str, Any]) -> LossTerms:
        if self.teacher_top_k is None:
            return divergence(
                self.kind, given["student_log_probs"], given["teacher_log_probs"], weights
            )
        ids = given["teacher_topk_ids"]
        if jnp.ndim(ids) != 3 or jnp.shape(ids)[-1] != self.teacher_top_k:
            raise _error(
                "teacher_topk_ids",
                f"have shape [B, L, loss.teacher_top_k={self.teacher_top_k}]",
                tuple(jnp.shape(ids)),
            )
        student = given.get("student_topk_logps")
        if student is None:
            student = gather_topk(given["student_log_probs"], ids)
        _check_shape("student_topk_logps", student, ids.shape, "`teacher_topk_ids`")
        return topk_divergence(
            self.kind, student, given["teacher_topk_logps"], weights, tail_floor=self.tail_floor
        )


def opd_loss(config: LossConfig | str, weights: jax.Array, **inputs: Any) -> LossTerms:
    """One-shot form of :class:`OpdLoss`: ``config`` is a ``LossConfig`` or a kind name."""
    loss = OpdLoss(kind=config) if isinstance(config, str) else OpdLoss.from_config(config)
    return loss(weights, **inputs)


__all__ = [
    "ADVANTAGES",
    "DEFAULT_TAIL_FLOOR",
    "DIVERGENCE_KINDS",
    "LOSS_KINDS",
    "LossTerms",
    "OpdLoss",
    "OpdWeights",
    "Weighted",
    "accumulate",
    "denominator",
    "divergence",
    "gather_topk",
    "grpo_advantages",
    "k3_kl",
    "opd_advantages",
    "opd_loss",
    "opd_weights",
    "policy_gradient",
    "reverse_kl",
    "task_advantages",
    "topk_divergence",
]
