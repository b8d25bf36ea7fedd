"""OPD over the joint action of a planner rollout: token values and commit decisions.

A planner rollout's step ``t`` of a row is one joint action: the planner's commit draw for
every pending slot and the token of every slot it commits. Its reward is

    R_t = sum of r_p over the weighted tokens committed at t  -  forward_cost

with ``r_p = log q(x_p) - log pi(x_p)`` the per-token reverse-KL log-ratio (teacher minus
live student, stop-gradient) and ``forward_cost`` (``loss.forward_cost`` >= 0) charged once
per step (every step is one student forward: ``trace.forwards`` counts exactly the steps).
Advantages run along the denoising order, with the conventions of
:mod:`distill.losses` (``loss.advantage``), steps taking the place of tokens:

- ``return_to_go``: ``G_t = sum_{t' >= t} R_t'``; ``mean_to_go`` (default): ``G_t``
  divided by the number of tokens committed at steps ``>= t`` (so the cost reads as
  ``forward_cost`` divided by the remaining tokens per forward); both minus the batch mean
  of ``G`` over the rows that have a step ``t`` (the baseline at the same rank);
- ``token``: ``R_t`` alone; ``sequence``: the row's ``sum_t R_t`` minus its batch mean.

Every token committed at step ``t`` and every commit draw made at step ``t`` gets ``A_t``
in an importance-weighted (optionally PPO-clipped) policy gradient
(:func:`~distill.losses.policy_gradient`), behaviour log-probs from the trace
(``action_logps``, ``decision_logps``). Token terms carry the OPD weights; each draw of a row
with any weight carries weight 1. The loss is ``token total + decision total (+
kl_reference_weight * k3)`` over the denominator ``sum(weights)``, the one every OPD loss
uses, so accumulation and an all-zero batch behave as in :mod:`distill.losses`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from distill.config import LossConfig
from distill.losses import ADVANTAGES, k3_kl, policy_gradient
from distill.weighted import LossTerms, Weighted, safe_ratio


def _error(field: str, requirement: str, received: Any) -> ValueError:
    return ValueError(f"`{field}` must {requirement}; received {received!r}")


def step_advantages(
    log_ratio: jax.Array,
    weights: jax.Array,
    present: jax.Array,
    token_steps: jax.Array,
    *,
    forward_cost: float,
    advantage: str = "mean_to_go",
) -> tuple[jax.Array, jax.Array]:
    """Per-step advantages ``[B, S]`` (``S = N``: a step commits at least one token) and
    which steps exist (``[B, S]`` bool), from completion-space ``[B, N]`` arrays:
    ``log_ratio`` (stop-gradient), ``weights``, ``present`` (generated slots) and
    ``token_steps`` (each slot's commit step). See the module docstring."""
    if advantage not in ADVANTAGES:
        raise _error("advantage", f"be one of {ADVANTAGES}", advantage)
    batch, n = weights.shape
    active = weights > 0
    row_valid = active.any(axis=1)
    steps = jnp.where(present, token_steps, 0)
    row_steps = jnp.max(jnp.where(present, token_steps + 1, 0), axis=1)
    step_exists = row_valid[:, None] & (jnp.arange(n) < row_steps[:, None])
    rows = jnp.arange(batch)[:, None]
    r = jax.lax.stop_gradient(jnp.where(active, log_ratio, 0.0)).astype(jnp.float32)
    gains = jnp.zeros((batch, n), jnp.float32).at[rows, steps].add(r)
    rewards = jnp.where(step_exists, gains - forward_cost, 0.0)
    committed = jnp.zeros((batch, n), jnp.float32).at[rows, steps].add(present.astype(jnp.float32))
    if advantage == "token":
        return rewards, step_exists
    if advantage == "sequence":
        totals = rewards.sum(axis=1)
        baseline = safe_ratio(
            jnp.sum(jnp.where(row_valid, totals, 0.0)), jnp.sum(row_valid, dtype=jnp.float32)
        )
        return jnp.where(step_exists, (totals - baseline)[:, None], 0.0), step_exists
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards, axis=1), axis=1), axis=1)
    if advantage == "mean_to_go":
        tokens_to_go = jnp.flip(jnp.cumsum(jnp.flip(committed, axis=1), axis=1), axis=1)
        returns = safe_ratio(returns, tokens_to_go)
    count = jnp.sum(step_exists, axis=0, dtype=jnp.float32)
    baseline = safe_ratio(jnp.sum(jnp.where(step_exists, returns, 0.0), axis=0), count)
    return jnp.where(step_exists, returns - baseline[None, :], 0.0), step_exists


@dataclasses.dataclass(frozen=True)
class JointLoss:
    """The planner's OPD loss (hashable: a static jit argument). ``kind``,
    ``teacher_top_k`` and ``task_reward_weight`` are fixed: the joint policy gradient is a
    reverse-KL loss on the sampled tokens, without a task reward."""

    advantage: str = "mean_to_go"
    ppo_clip: float | None = None
    forward_cost: float = 0.0
    kl_reference_weight: float = 0.0
    kind: str = dataclasses.field(default="reverse_kl", init=False)
    teacher_top_k: None = dataclasses.field(default=None, init=False)
    task_reward_weight: float = dataclasses.field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise _error("loss.advantage", f"be one of {ADVANTAGES}", self.advantage)
        if self.ppo_clip is not None and not (
            isinstance(self.ppo_clip, int | float) and math.isfinite(self.ppo_clip)
        ):
            raise _error("loss.ppo_clip", "be a number > 0 or None", self.ppo_clip)
        if self.ppo_clip is not None and self.ppo_clip <= 0:
            raise _error("loss.ppo_clip", "be > 0 or None", self.ppo_clip)
        for field in ("forward_cost", "kl_reference_weight"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _error(f"loss.{field}", "be a number >= 0", value)
            if not (math.isfinite(value) and value >= 0):
                raise _error(f"loss.{field}", "be finite and >= 0", value)

    @classmethod
    def from_config(cls, config: LossConfig) -> JointLoss:
        if config.kind != "reverse_kl" or config.task_reward_weight > 0:
            raise _error(
                "loss.kind",
                "be 'reverse_kl' without a task reward for the planner's joint loss",
                (config.kind, config.task_reward_weight),
            )
        return cls(
            advantage=config.advantage,
            ppo_clip=config.ppo_clip,
            forward_cost=config.forward_cost,
            kl_reference_weight=config.kl_reference_weight,
        )

    def __call__(
        self,
        weights: jax.Array,
        *,
        present: jax.Array,
        student_logps: jax.Array,
        behaviour_logps: jax.Array,
        teacher_logps: jax.Array,
        token_steps: jax.Array,
        decision_logps: jax.Array,
        behaviour_decision_logps: jax.Array,
        drawn: jax.Array,
        decision_steps: jax.Array,
        reference_logps: jax.Array | None = None,
    ) -> LossTerms:
        """Completion-space inputs: ``[B, N]`` (``weights``, ``present``, token log-probs,
        ``token_steps``) and ``[B, N, K]`` (draw log-probs live / behaviour, ``drawn``,
        ``decision_steps``: the step of each draw). Returns the weighted sum, its
        denominator ``sum(weights)`` and metrics."""
        shape = jnp.shape(weights)
        if len(shape) != 2:
            raise _error("weights", "be [B, N]", shape)
        for name, array in (
            ("present", present),
            ("student_logps", student_logps),
            ("behaviour_logps", behaviour_logps),
            ("teacher_logps", teacher_logps),
            ("token_steps", token_steps),
        ):
            if jnp.shape(array) != shape:
                raise _error(name, f"have the shape of weights {shape}", jnp.shape(array))
        wide = jnp.shape(drawn)
        if len(wide) != 3 or wide[:2] != shape:
            raise _error("drawn", f"be [{shape[0]}, {shape[1]}, K]", wide)
        for name, array in (
            ("decision_logps", decision_logps),
            ("behaviour_decision_logps", behaviour_decision_logps),
            ("decision_steps", decision_steps),
        ):
            if jnp.shape(array) != wide:
                raise _error(name, f"have the shape of drawn {wide}", jnp.shape(array))
        if self.kl_reference_weight > 0 and reference_logps is None:
            raise _error("reference_logps", "be given when kl_reference_weight > 0", None)
        active = (weights > 0) & jnp.isfinite(weights)
        scored = active & jnp.isfinite(teacher_logps)
        frozen = jax.lax.stop_gradient(jnp.where(active, student_logps, 0.0))
        log_ratio = jnp.where(scored, jnp.where(scored, teacher_logps, 0.0) - frozen, 0.0)
        advantages, step_exists = step_advantages(
            log_ratio,
            weights,
            present,
            token_steps,
            forward_cost=self.forward_cost,
            advantage=self.advantage,
        )
        batch, n = shape
        token_advantages = jnp.take_along_axis(
            advantages, jnp.clip(token_steps, 0, n - 1).astype(jnp.int32), axis=1
        )
        tokens = policy_gradient(
            student_logps, behaviour_logps, token_advantages, weights, ppo_clip=self.ppo_clip
        )
        row_valid = active.any(axis=1)
        decision_weights = jnp.where(drawn & row_valid[:, None, None], 1.0, 0.0)
        flat_steps = jnp.clip(decision_steps, 0, n - 1).astype(jnp.int32).reshape(batch, -1)
        draw_advantages = jnp.take_along_axis(advantages, flat_steps, axis=1)
        draws = policy_gradient(
            decision_logps.reshape(batch, -1),
            behaviour_decision_logps.reshape(batch, -1),
            draw_advantages,
            decision_weights.reshape(batch, -1),
            ppo_clip=self.ppo_clip,
        )
        total = tokens.total + draws.total
        steps = jnp.sum(step_exists, dtype=jnp.float32)
        rows = jnp.sum(row_valid, dtype=jnp.float32)
        committed = jnp.sum(present & row_valid[:, None], dtype=jnp.float32)
        metrics = dict(tokens.metrics)
        metrics |= {f"decision_{name}": value for name, value in draws.metrics.items()}
        metrics["reverse_kl"] = Weighted(
            jnp.sum(jnp.where(scored, -log_ratio * weights, 0.0)),
            jnp.sum(jnp.where(scored, weights, 0.0)),
        )
        metrics["teacher_nonfinite"] = Weighted(
            jnp.sum(active & ~scored, dtype=jnp.float32), jnp.sum(active, dtype=jnp.float32)
        )
        metrics["forwards_per_row"] = Weighted(steps, rows)
        metrics["tokens_per_step"] = Weighted(committed, steps)
        if self.kl_reference_weight > 0:
            k3 = k3_kl(student_logps, reference_logps, weights)
            metrics["kl_reference"] = k3.metrics["k3"]
            total = total + self.kl_reference_weight * k3.total
        return LossTerms(total, tokens.denominator, metrics)
