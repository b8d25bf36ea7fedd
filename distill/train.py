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
zero total weight gives a loss of exactly 0 and zero gradients. ``layout.loss_weights`` must
be finite and >= 0: :meth:`Trainer.step` refuses others; inside the jitted step they count as
0 and the ``invalid_weights`` metric says how many there were (treat > 0 as an error).

Buffer ownership: a step donates the trainer's state, deleting its old buffers. The trainer
therefore never shares buffers with the model it was given (nor with any ``nnx.clone`` of
it, which shares the model's arrays): it copies the state when it starts and again on every
:meth:`Trainer.sync`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, get_args

import jax
import jax.numpy as jnp
import optax
import tqdm
from flax import nnx

from distill.config import OptimizerConfig, StopFill
from distill.data.stream import TaskStream, encode_example
from distill.data.tasks import Example
from distill.diffusion.layout import BlockLayout, build_training_layout
from distill.diffusion.objectives import combine
from distill.models.transformer import Transformer
from distill.tokenizer import Tokenizer
from distill.weighted import check_weights, invalid_weights


class TrainingObjective(Protocol):
    def plan(self, layout: BlockLayout, keys: jax.Array, step: jax.Array | int = 0) -> Any: ...

    def denominators(self, layout: BlockLayout, plan: Any) -> dict[str, jax.Array]: ...

    def sums(
        self, model: Transformer, layout: BlockLayout, plan: Any, keys: jax.Array
    ) -> dict[str, jax.Array]: ...

    def coefficients(self, plan: Any) -> Mapping[str, jax.Array | float]: ...


@functools.cache
def make_optimizer(
    config: OptimizerConfig, total_steps: int | None = None
) -> optax.GradientTransformation:
    """AdamW with linear warm-up, then a constant or cosine-decayed learning rate (the
    cosine needs ``total_steps``), optional global-norm clipping."""
    # Cached: the transformation is stateless, and one instance per (config, steps) keeps
    # the optimizer's graphdef (a static jit argument) equal across rebuilds, so a resumed
    # or re-created phase reuses its compiled step instead of compiling it again.
    if config.schedule == "cosine":
        if total_steps is None or total_steps <= config.warmup_steps:
            raise ValueError(
                f"`total_steps` must exceed optimizer.warmup_steps={config.warmup_steps} for "
                f"a cosine schedule; received {total_steps}"
            )
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, config.learning_rate, max(config.warmup_steps, 1), total_steps
        )
    elif config.warmup_steps:
        schedule = optax.join_schedules(
            [
                optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
                optax.constant_schedule(config.learning_rate),
            ],
            [config.warmup_steps],
        )
    else:
        schedule = optax.constant_schedule(config.learning_rate)
    parts = [] if config.grad_clip is None else [optax.clip_by_global_norm(config.grad_clip)]
    parts.append(optax.adamw(schedule, weight_decay=config.weight_decay))
    return optax.chain(*parts)


def make_train_state(
    model: Transformer, config: OptimizerConfig, total_steps: int | None = None
) -> nnx.Optimizer:
    return nnx.Optimizer(model, make_optimizer(config, total_steps), wrt=nnx.Param)


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
    metrics["invalid_weights"] = _invalid_count(layout)
    return loss, metrics


def _invalid_count(layout: BlockLayout) -> jax.Array:
    """How many ``loss_weights`` are negative or non-finite (the objectives use them as 0)."""
    return jnp.sum(invalid_weights(layout.loss_weights), dtype=jnp.float32)


def row_slice(tree: Any, batch: int, count: int, index: jax.Array) -> Any:
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
        micro = row_slice((layout, plan, keys), batch, microbatches, index)
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
    metrics["invalid_weights"] = _invalid_count(layout)
    return loss, grads, metrics


def _update(optimizer, model, layout, keys, step, objective, microbatches):
    loss, grads, metrics = accumulated_gradients(objective, model, layout, keys, step, microbatches)
    optimizer.update(model, grads)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}


@functools.partial(
    jax.jit, static_argnames=("graphdef", "objective", "microbatches"), donate_argnums=(1,)
)
def _pure_step(graphdef, state, layout, keys, step, objective, microbatches):
    optimizer, model = nnx.merge(graphdef, state)
    metrics = _update(optimizer, model, layout, keys, step, objective, microbatches)
    return nnx.state((optimizer, model)), metrics


def _private(state: nnx.State) -> nnx.State:
    """Fresh buffers for every array of ``state`` (a donated step may delete these)."""
    return jax.tree.map(jnp.copy, state)


class Trainer:
    """Holds a model and its optimizer as one flat state between jitted steps.

    Splitting an NNX graph costs milliseconds per call on the host; the trainer splits once,
    steps on the flat state (donated, updated in place on device), and writes it back into
    ``model`` / ``optimizer`` only when :meth:`sync` is called (before evaluation or a
    checkpoint). Between syncs the model keeps its last synced values.

    The flat state is the trainer's own copy, never an array the model (or an ``nnx.clone``
    of it, made before or after the trainer) holds: donation then deletes only buffers no
    one else can see. The price is one copy of the parameters and optimizer state, at the
    start and at each sync.
    """

    def __init__(self, model: Transformer, optimizer: nnx.Optimizer):
        self.model = model
        self.optimizer = optimizer
        graphdef, state = nnx.split((optimizer, model))
        self._graphdef, self._state = graphdef, _private(state)

    def step(
        self,
        layout: BlockLayout,
        keys: jax.Array,
        step: int,
        *,
        objective: TrainingObjective,
        microbatches: int = 1,
    ) -> dict[str, jax.Array]:
        """One optimizer update; returns metrics (loss, grad norm, per-term parts,
        ``invalid_weights``). Refuses negative or non-finite ``layout.loss_weights``."""
        check_weights("layout.loss_weights", layout.loss_weights)
        self._state, metrics = _pure_step(
            self._graphdef,
            self._state,
            layout,
            keys,
            jnp.int32(step),
            objective,
            microbatches,
        )
        return metrics

    def sync(self) -> Transformer:
        """Write (a copy of) the trained state into the model and optimizer; return the
        model. The copy keeps the next donated step from deleting the model's arrays."""
        nnx.update((self.optimizer, self.model), _private(self._state))
        return self.model


@functools.partial(jax.jit, static_argnames=("batch", "stream"))
def batch_keys(seed: int, step: int, batch: int, *, stream: int = 0) -> jax.Array:
    """One key per row from (seed, step, stream id, row): independent of microbatching."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)
    return jax.vmap(lambda row: jax.random.fold_in(base, row))(jnp.arange(batch))


def task_layout(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    *,
    horizon: int,
    block_size: int,
    stop_fill: StopFill = "none",
) -> BlockLayout:
    """Encode (prompt, answer + stop) pairs into a block-aligned training layout;
    ``stop_fill="block"`` fills each stop's block with the stop id (``build_training_layout``'s
    ``fill_id``)."""
    if stop_fill not in get_args(StopFill):
        raise ValueError(f"`stop_fill` must be one of {get_args(StopFill)}; received {stop_fill!r}")
    pairs = [encode_example(example, tokenizer) for example in examples]
    special = tokenizer.special
    return build_training_layout(
        [prompt for prompt, _ in pairs],
        [answer for _, answer in pairs],
        horizon=horizon,
        block_size=block_size,
        pad_id=special.pad_id,
        mask_id=special.mask_id,
        vocab_size=tokenizer.vocab_size,
        fill_id=special.stop_ids[0] if stop_fill == "block" else None,
    )


def fit(
    trainer: Trainer,
    objective: TrainingObjective,
    stream: TaskStream,
    tokenizer: Tokenizer,
    *,
    steps: int,
    horizon: int,
    seed: int,
    start_step: int = 0,
    microbatches: int = 1,
    progress: bool = True,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    stop_fill: StopFill = "none",
) -> list[dict[str, float]]:
    """Train for ``steps`` steps from ``start_step``; step k reads stream positions
    ``[k * batch_size, (k + 1) * batch_size)``. Returns per-step metrics; the trainer's
    model is synced at the end. ``stop_fill`` as in :func:`task_layout` (a block-diffusion
    student's warm-up uses ``objective.stop_fill``; the causal teacher ``none``)."""
    if steps < 0 or start_step < 0:
        raise ValueError(f"`steps` and `start_step` must be >= 0; received {steps}, {start_step}")
    history = []
    size = stream.batch_size
    bar = tqdm.trange(
        start_step, start_step + steps, disable=not progress, desc="train", unit="step"
    )
    for step in bar:
        layout = task_layout(
            stream.batch(step * size, size),
            tokenizer,
            horizon=horizon,
            block_size=trainer.model.config.block_size,
            stop_fill=stop_fill,
        )
        metrics = trainer.step(
            layout,
            batch_keys(seed, step, size),
            step,
            objective=objective,
            microbatches=microbatches,
        )
        values = {name: float(value) for name, value in metrics.items()}
        history.append(values)
        bar.set_postfix(loss=f"{values['loss']:.3f}")
        if on_step is not None:
            on_step(step, values)
    trainer.sync()
    return history
