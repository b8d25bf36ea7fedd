"""Logical axis names for parameters and activations, and their mapping onto a device mesh.

Parameters carry logical names (``embed``, ``vocab``, ``heads``, ...) set at init time.
:data:`LOGICAL_AXIS_RULES` maps them to the mesh axes ``data`` and ``model``. Activation
constraints are applied only inside :func:`use_mesh`; outside it the model runs unsharded.

Multi-host (one ``jax.distributed`` world over a slice): :func:`make_mesh` over
``jax.devices()`` is the world's global mesh, one host's devices per row of ``data``, so
``model`` splits within a host and ``data`` across hosts. Every process runs the same
program: :func:`shard_state` places the parameters and optimizer state, :func:`global_batch`
turns the global batch (which every process builds whole, deterministically) into arrays
sharded over ``data``, one jitted step is then one SPMD program over all hosts, and
:func:`gather` brings a result back to every host (a collective: all processes call it).
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


def shard_state(nodes: object, mesh: Mesh) -> None:
    """Place the state of ``nodes`` (an nnx graph node or a tuple of them, e.g.
    ``(optimizer, model)``) on ``mesh`` in place: annotated variables by the logical axis
    rules (an optimizer's moments carry their parameter's names), the rest replicated; an
    axis the mesh axis does not divide (a vocabulary of 51) is replicated instead.
    In a multi-process world every process calls it with the same values."""
    state = nnx.state(nodes)
    with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
        shardings = nnx.get_named_sharding(state, mesh)
    nnx.update(
        nodes,
        jax.tree.map(
            lambda value, sharding: _place_replicated_value(
                value, _divisible(sharding, np.shape(value))
            ),
            state,
            shardings,
        ),
    )


def _divisible(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    def size(axes: str | tuple[str, ...] | None) -> int:
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return int(np.prod([sharding.mesh.shape[name] for name in names]))

    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    fitted = [
        axes if dim % size(axes) == 0 else None for axes, dim in zip(spec, shape, strict=True)
    ]
    return NamedSharding(sharding.mesh, PartitionSpec(*fitted))


def _place_replicated_value(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    # Every process holds the whole value: each builds its own shards from it, which needs
    # no transfer between hosts (device_put of one host's array cannot reach another's).
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def global_batch(tree: object, mesh: Mesh) -> object:
    """The arrays of ``tree`` (whole global batch on every process, leading axis = batch,
    which ``data`` must divide) as global arrays sharded over ``data``; scalars replicated.
    Typed PRNG key arrays are placed through their key data."""

    def place(leaf: object) -> object:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            return leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                place(jax.random.key_data(leaf)), impl=jax.random.key_impl(leaf)
            )
        host = np.asarray(leaf)
        if host.ndim == 0:
            return _place_replicated_value(host, NamedSharding(mesh, PartitionSpec()))
        if host.shape[0] % mesh.shape[DATA_AXIS]:
            raise ValueError(
                f"`batch` must be divisible by the mesh's data axis ({mesh.shape[DATA_AXIS]}); "
                f"received a leaf of shape {host.shape}"
            )
        return _place_replicated_value(host, batch_sharding(mesh, host.ndim))

    return jax.tree.map(place, tree)


def gather(tree: object) -> object:
    """Every array of ``tree`` whole, as numpy, on every process (global arrays are
    all-gathered: every process of the world must call it)."""
    from jax.experimental import multihost_utils

    def fetch(leaf: object) -> object:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf

    return jax.tree.map(fetch, tree)
