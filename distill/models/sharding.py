"""Logical axis names for parameters and activations, and their mapping onto a device mesh.

Parameters carry logical names (``embed``, ``vocab``, ``heads``, ...) set at init time.
:data:`LOGICAL_AXIS_RULES` maps them to the mesh axes ``data`` and ``model``. Activation
constraints are applied only inside :func:`use_mesh`; outside it the model runs unsharded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"

# Logical axis -> mesh axis (None = replicated). Batch is data-parallel; the vocabulary,
# attention heads and MLP hidden units are model-parallel (Megatron-style).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA_AXIS),
    ("length", None),
    ("embed", None),
    ("vocab", MODEL_AXIS),
    ("heads", MODEL_AXIS),
    ("kv_heads", MODEL_AXIS),
    ("head_dim", None),
    ("mlp", MODEL_AXIS),
    ("norm", None),
)

_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "distill_active_mesh", default=None
)


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(
            f"`mesh` must fit the {len(devices)} available devices with data, model >= 1; "
            f"received data={data}, model={model}"
        )
    grid = np.array(devices[: data * model]).reshape(data, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def logical_to_spec(logical_axes: Sequence[str | None]) -> PartitionSpec:
    rules = dict(LOGICAL_AXIS_RULES)
    unknown = [axis for axis in logical_axes if axis is not None and axis not in rules]
    if unknown:
        raise ValueError(f"`logical_axes` must be names in LOGICAL_AXIS_RULES; received {unknown}")
    return PartitionSpec(*(None if axis is None else rules[axis] for axis in logical_axes))


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Within this context, activations get sharding constraints on ``mesh``."""
    token = _ACTIVE_MESH.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def constrain(array: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Apply a sharding constraint by logical names when a mesh is active; else identity."""
    mesh = _ACTIVE_MESH.get()
    if mesh is None:
        return array
    return jax.lax.with_sharding_constraint(
        array, NamedSharding(mesh, logical_to_spec(logical_axes))
    )


def param_shardings(module: nnx.Module, mesh: Mesh) -> nnx.State:
    """NamedShardings for every parameter of ``module`` from its logical annotations."""
    with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        return nnx.get_named_sharding(nnx.state(module), mesh)


def shard_module(module: nnx.Module, mesh: Mesh) -> None:
    """Place ``module``'s state on ``mesh`` in place, following the logical axis rules."""
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, param_shardings(module, mesh)))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Shard the leading (batch) axis over ``data``; replicate the rest."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS, *([None] * (ndim - 1))))
