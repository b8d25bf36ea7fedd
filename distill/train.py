"""Jitted training steps: optax updates with gradient accumulation over microbatches.

A training objective is anything with the plan / denominators / sums / coefficients
interface of :class:`~distill.diffusion.objectives.Objective` (block-diffusion warm-up) or
:class:`~distill.diffusion.objectives.CausalLM` (the teacher). One step:

1. ``plan`` draws all model-independent randomness for the whole batch (one key per row);
2. ``denominators`` of the whole batch are the global denominators;
3. the batch is cut into ``microbatches`` row slices scanned in order; each contributes the
   gradient of ``sum_t coefficient_t * sums_t / global_denominator_t``;
4. the summed gradient goes through optax once.

So accumulation over microbatches gives the same update as the whole batch, and a batch with
zero total weight gives a loss of exactly 0 and zero gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from distill.config import OptimizerConfig
from distill.diffusion.layout import BlockLayout
from distill.diffusion.objectives import combine
from distill.models.transformer import Transformer


class TrainingObjective(Protocol):
    def plan(self, layout: BlockLayout, keys: jax.Array, step: jax.Array | int = 0) -> Any: ...

    def denominators(self, layout: BlockLayout, plan: Any) -> dict[str, jax.Array]: ...

    def sums(
        self, model: Transformer, layout: BlockLayout, plan: Any, keys: jax.Array
    ) -> dict[str, jax.Array]: ...

    def coefficients(self, plan: Any) -> Mapping[str, jax.Array | float]: ...


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, optional global-norm clipping."""
    if config.warmup_steps:
        schedule = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
    else:
        schedule = optax.constant_schedule(config.learning_rate)
    parts = [] if config.grad_clip is None else [optax.clip_by_global_norm(config.grad_clip)]
    parts.append(optax.adamw(schedule, weight_decay=config.weight_decay))
    return optax.chain(*parts)


def make_train_state(model: Transformer, config: OptimizerConfig) -> nnx.Optimizer:
    return nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)


def loss_and_metrics(
    objective: TrainingObjective,
    model: Transformer,
    layout: BlockLayout,
    keys: jax.Array,
    step: jax.Array | int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The batch's scalar loss (its own denominators) and per-term sums / denominators."""
    plan = objective.plan(layout, keys, step)
    denominators = objective.denominators(layout, plan)
    sums = objective.sums(model, layout, plan, keys)
    loss = combine(sums, denominators, objective.coefficients(plan))
    metrics = {f"{name}/sum": value for name, value in sums.items()}
    metrics |= {f"{name}/denominator": value for name, value in denominators.items()}
    return loss, metrics


def _row_slice(tree: Any, batch: int, count: int, index: jax.Array) -> Any:
    """Slice ``index`` of ``count`` equal row slices from every ``[batch, ...]`` leaf; leaves
    without that leading axis (e.g. a scalar schedule) are shared by every slice."""

    def take(leaf):
        if hasattr(leaf, "shape") and leaf.ndim and leaf.shape[0] == batch:
            return leaf.reshape(count, batch // count, *leaf.shape[1:])[index]
        return leaf

    return jax.tree.map(take, tree)


def accumulated_gradients(
    objective: TrainingObjective,
    model: Transformer,
    layout: BlockLayout,
    keys: jax.Array,
    step: jax.Array | int,
    microbatches: int,
) -> tuple[jax.Array, nnx.State, dict[str, jax.Array]]:
    """Loss, parameter gradients and metrics of one batch, accumulated over row slices."""
    batch = layout.tokens.shape[0]
    if microbatches < 1 or batch % microbatches:
        raise ValueError(
            f"`microbatches` must divide the batch size {batch}; received {microbatches}"
        )
    plan = objective.plan(layout, keys, step)
    denominators = objective.denominators(layout, plan)
    coefficients = objective.coefficients(plan)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(params, micro):
        micro_layout, micro_plan, micro_keys = micro
        student = nnx.merge(graphdef, params, rest)
        sums = objective.sums(student, micro_layout, micro_plan, micro_keys)
        return combine(sums, denominators, coefficients), sums

    def body(carry, index):
        loss, grads, sums = carry
        micro = _row_slice((layout, plan, keys), batch, microbatches, index)
        (micro_loss, micro_sums), micro_grads = jax.value_and_grad(loss_of, has_aux=True)(
            params, micro
        )
        grads = jax.tree.map(jnp.add, grads, micro_grads)
        sums = {name: sums[name] + micro_sums[name] for name in sums}
        return (loss + micro_loss, grads, sums), None

    zero_sums = {name: jnp.float32(0.0) for name in denominators}
    init = (jnp.float32(0.0), jax.tree.map(jnp.zeros_like, params), zero_sums)
    (loss, grads, sums), _ = jax.lax.scan(body, init, jnp.arange(microbatches))
    metrics = {f"{name}/sum": value for name, value in sums.items()}
    metrics |= {f"{name}/denominator": value for name, value in denominators.items()}
    return loss, grads, metrics


@functools.partial(nnx.jit, static_argnames=("objective", "microbatches"))
def train_step(
    optimizer: nnx.Optimizer,
    model: Transformer,
    layout: BlockLayout,
    keys: jax.Array,
    step: jax.Array,
    *,
    objective: TrainingObjective,
    microbatches: int = 1,
) -> dict[str, jax.Array]:
    """One optimizer update in place; returns metrics (loss, grad norm, per-term parts)."""
    loss, grads, metrics = accumulated_gradients(objective, model, layout, keys, step, microbatches)
    optimizer.update(model, grads)
    return {"loss": loss, "grad_norm": optax.global_norm(grads), **metrics}


def batch_keys(seed: int, step: int, batch: int, *, stream: int = 0) -> jax.Array:
    """One key per row from (seed, step, stream id, row): independent of microbatching."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)
    return jax.vmap(lambda row: jax.random.fold_in(base, row))(jnp.arange(batch))
