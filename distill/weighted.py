"""Weighted sums with explicit denominators, shared by the training objectives
(:mod:`distill.diffusion.objectives`) and the OPD losses (:mod:`distill.losses`).

A loss or metric is carried as a pair ``(total, denominator)``: ``total`` is a weighted SUM
(never a mean) and ``denominator`` the sum of the weights. Gradient accumulation adds pairs
over microbatches and hosts (:func:`accumulate`) and divides once (:func:`safe_ratio`), so
the result does not depend on how the batch was split. A zero denominator gives exactly 0
with a zero gradient, never NaN. Sums are float32 and apply weights with ``where``, so NaN
or inf on excluded entries cannot leak into them (:func:`f32_sum`).

Weights are finite and >= 0 (loss weights, not reward scales). :func:`check_weights` refuses
any other value where the weights are concrete; under ``jit`` callers treat such weights as
0 and count them (:func:`invalid_weights`) in a metric the caller must treat as an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def f32_sum(values: jax.Array, where: jax.Array) -> jax.Array:
    """The float32 sum of ``values`` where ``where`` is true; other entries, NaN or inf
    included, contribute exactly 0."""
    return jnp.sum(jnp.where(where, values, 0.0), dtype=jnp.float32)


def invalid_weights(weights: jax.Array) -> jax.Array:
    """True where a weight is negative or non-finite (NaN, +-inf): not a loss weight."""
    weights = jnp.asarray(weights)
    return ~(jnp.isfinite(weights) & (weights >= 0))


def check_weights(field: str, weights: Any) -> None:
    """Raise unless every weight is finite and >= 0, when ``weights`` is concrete (eager
    calls, or a constant under ``jit``). A traced value cannot be read here: the caller
    zeroes :func:`invalid_weights` entries and counts them instead."""
    if isinstance(weights, jax.core.Tracer):
        return
    if isinstance(weights, jax.Array) and not weights.is_fully_addressable:
        # A batch sharded over a multi-process world: every process gathers it all, so all
        # refuse together (one refusing alone would leave the others waiting in the step).
        from jax.experimental import multihost_utils

        weights = multihost_utils.process_allgather(weights, tiled=True)
    values = np.asarray(weights)
    bad = ~(np.isfinite(values) & (values >= 0))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"`{field}` must be finite and >= 0; received {int(bad.sum())} bad value(s), "
            f"first {values[first].item()!r} at {first}"
        )


def safe_ratio(total: jax.Array, denominator: jax.Array) -> jax.Array:
    """``total / denominator``, exactly 0 (with zero gradient) when the denominator is 0."""
    positive = denominator > 0
    return jnp.where(positive, total / jnp.where(positive, denominator, 1.0), 0.0)


class Weighted(NamedTuple):
    """A weighted sum and its denominator; :meth:`value` is their ratio (0 when empty)."""

    total: jax.Array
    denominator: jax.Array

    def value(self) -> jax.Array:
        return safe_ratio(self.total, self.denominator)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossTerms:
    """A loss as ``total`` (weighted sum) over ``denominator``, with metrics of the same
    form. Add over microbatches with :func:`accumulate`, divide once with :meth:`value`."""

    total: jax.Array
    denominator: jax.Array
    metrics: dict[str, Weighted] = dataclasses.field(default_factory=dict)

    def value(self) -> jax.Array:
        """``total / denominator``; exactly 0 (with zero gradient) when the denominator is 0."""
        return safe_ratio(self.total, self.denominator)

    def metric_values(self) -> dict[str, jax.Array]:
        return {name: metric.value() for name, metric in self.metrics.items()}


def accumulate(first: LossTerms, second: LossTerms) -> LossTerms:
    """Sum totals, denominators and metric pairs of two microbatches (same metric names)."""
    return jax.tree.map(jnp.add, first, second)
