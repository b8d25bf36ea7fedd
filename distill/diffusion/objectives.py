"""Block-diffusion training objectives (and the causal teacher's next-token CE).

Every objective is split in two pure, jit-able halves so that gradient accumulation can use
global denominators:

- ``plan(layout, keys, step)`` draws every model-independent random choice (noise levels,
  corruption, which masked slots get self-generated tokens, coordination subsets) from one
  key per row; ``denominators(layout, plan)`` reads the denominators off the plan.
- ``sums(model, layout, plan, keys)`` runs the model and returns the weighted sums.

The loss of a batch is ``sum_t coefficient_t * sum_t / denominator_t`` with the
denominators summed over all microbatches first (:func:`combine`). A zero denominator gives a
loss of exactly 0 with zero gradients; weights are applied with ``where`` so NaN/inf on
inactive slots never leak. ``layout.loss_weights`` (``block_ce`` and the causal CE) must be
finite and >= 0: refused when concrete; under ``jit`` an invalid weight counts as 0 (the
training step reports how many in its ``invalid_weights`` metric).

Objectives (``ObjectiveConfig.kind``):

- ``block_ce``: cross-entropy on the targets weighted by ``loss_weights``.
- ``mdlm``: targets weighted by 1/t (anchors: 1), normalized by the completion length.
- ``self_corrupted``: a no-grad pass samples every masked slot independently from the
  model's own marginals; a random subset (rate ``k_frac * ramp``) is committed to those
  samples; the model is trained on the remaining masked slots given that context (as
  MDLM), plus ``repair_weight`` times the CE of the true token at the committed slots.
  With ``ramp = 0`` it equals ``mdlm`` on the same keys.
- ``coordination``: for up to ``group`` masked slots S of one block, a no-grad pass decodes
  S sequentially (each pick conditioned on the earlier ones) into a joint sample; the loss
  is the CE of that joint sample under the one-pass parallel marginals.
- ``cmd``: ``mdlm + alpha * self_corrupted + beta * ramp * coordination``.

``ramp = min(1, step / ramp_steps)`` grows from zero. ``context`` picks how the noisy block
sees earlier blocks: ``clean`` (packed canvas chunks against the clean row, as at
inference; the default) or ``corrupted`` (one sequence, each block with its own noise).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from distill.config import ObjectiveConfig
from distill.diffusion import alignment as align
from distill.diffusion.corruption import Corruption, check_mask_id, corrupt
from distill.diffusion.layout import BlockLayout
from distill.models.logprobs import gathered_log_probs
from distill.models.transformer import Transformer
from distill.weighted import check_weights, f32_sum, invalid_weights, safe_ratio

OBJECTIVES = ("block_ce", "mdlm", "self_corrupted", "coordination", "cmd")


def combine(
    sums: Mapping[str, jax.Array],
    denominators: Mapping[str, jax.Array],
    coefficients: Mapping[str, jax.Array | float],
) -> jax.Array:
    """The scalar loss ``sum_t coefficient_t * sums_t / denominators_t``."""
    return sum(
        (coefficients[name] * safe_ratio(sums[name], denominators[name]) for name in sums),
        start=jnp.float32(0.0),
    )


def ramp(step: jax.Array | int, ramp_steps: int) -> jax.Array:
    """Schedule in [0, 1] growing linearly from 0 over ``ramp_steps`` steps."""
    if ramp_steps == 0:
        return jnp.float32(1.0)
    return jnp.clip(jnp.asarray(step, jnp.float32) / ramp_steps, 0.0, 1.0)


def loss_weights(layout: BlockLayout) -> jax.Array:
    """``layout.loss_weights``, refused when concrete and negative or non-finite; traced,
    such entries are 0 (so they can neither flip a term's sign nor make it NaN)."""
    check_weights("layout.loss_weights", layout.loss_weights)
    weights = layout.loss_weights
    return jnp.where(invalid_weights(weights), 0.0, weights)


def _fold(keys: jax.Array, tag: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, tag))(keys)


# ---- forwards ---------------------------------------------------------------------------


def target_hidden(
    model: Transformer,
    layout: BlockLayout,
    canvas: jax.Array,
    *,
    alignment: str,
    context: str,
) -> jax.Array:
    """``[B, L, d]`` hidden states whose logits predict ``layout.tokens`` at each slot,
    when the student reads ``canvas`` (garbage where a slot has no source).

    ``corrupted``: one forward of the canvas, sources matched by logical position.
    ``clean``: the clean row once (block-causal) and one canvas chunk per block window from
    ``layout.first_window`` on, each attending to the cached clean earlier blocks
    (block-sparse). A ``shifted`` target whose previous position lies in the previous block
    (an anchor) reads the clean row, as at inference.
    """
    if context == "corrupted":
        hidden = model.hidden_states(canvas, layout.positions, layout.segment_ids)
        sources = align.source_slots(layout.positions, layout.segment_ids, alignment)
        return align.gather_sources(hidden, sources)
    if context != "clean":
        raise ValueError(f"`context` must be 'clean' or 'corrupted'; received {context!r}")
    batch, length = layout.tokens.shape
    size, first = layout.block_size, layout.first_window
    n_chunks = length // size - first
    clean, cache = model.prefill(layout.tokens, layout.positions, layout.segment_ids)

    def chunked(array):
        return array[:, first * size :].reshape(batch, n_chunks, size)

    chunks = model.chunk_hidden_states(
        cache, chunked(canvas), chunked(layout.positions), chunked(layout.segment_ids)
    ).reshape(batch, n_chunks * size, -1)
    slots = jnp.arange(length)
    source = slots - (1 if alignment == "shifted" else 0)
    in_block = (source // size == slots // size) & (slots >= first * size)
    index = jnp.where(in_block, length + source - first * size, source)
    index = jnp.broadcast_to(jnp.maximum(index, 0), (batch, length))
    return jnp.take_along_axis(jnp.concatenate([clean, chunks], axis=1), index[..., None], 1)


def token_log_probs(
    model: Transformer,
    hidden: jax.Array,
    targets: jax.Array,
    *,
    mask_id: int,
    vocab_chunk: int | None = 4096,
) -> jax.Array:
    """Log-prob of ``targets`` under the logits of ``hidden`` (mask id excluded)."""
    return gathered_log_probs(
        hidden, model.output_embedding(), targets, excluded_id=mask_id, vocab_chunk=vocab_chunk
    )


def _sample(model: Transformer, hidden: jax.Array, keys: jax.Array, mask_id: int) -> jax.Array:
    """Independent samples ``[B, L]`` from each slot's distribution (mask id excluded)."""
    logits = model.logits(hidden).at[..., mask_id].set(-jnp.inf)
    return jax.vmap(lambda key, row: jax.random.categorical(key, row, axis=-1))(keys, logits)


# ---- plans ------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """Model-independent randomness of one objective evaluation.

    ``corruption``; ``commit_mask`` (self-corrupted: masked slots that get a self-generated
    token); ``coordination_order`` ``[B, G]`` slots decoded sequentially (-1 = none);
    ``ramp`` (scalar)."""

    corruption: Corruption
    commit_mask: jax.Array
    coordination_order: jax.Array
    ramp: jax.Array


def _coordination_order(
    layout: BlockLayout, corruption: Corruption, keys: jax.Array, group: int
) -> jax.Array:
    """Up to ``group`` corrupted slots of one block per row, in a random order."""
    length = layout.tokens.shape[1]
    scores = jax.vmap(lambda key: jax.random.uniform(key, (length,)))(keys)
    candidates = corruption.corruption_mask
    scores = jnp.where(candidates, scores, 2.0)
    block = layout.positions // layout.block_size
    chosen_block = jnp.take_along_axis(block, jnp.argmin(scores, axis=1)[:, None], axis=1)
    in_block = candidates & (block == chosen_block)
    ranked = jnp.argsort(jnp.where(in_block, scores, 2.0), axis=1, stable=True)[:, :group]
    present = jnp.take_along_axis(in_block, ranked, axis=1)
    return jnp.where(present, ranked, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A configured objective; see the module docstring. Hashable (usable as a static)."""

    config: ObjectiveConfig
    mask_id: int
    vocab_chunk: int | None = 4096

    def __post_init__(self) -> None:
        if self.config.kind not in OBJECTIVES:
            raise ValueError(
                f"`objective.kind` must be one of {OBJECTIVES}; received {self.config.kind!r}"
            )
        check_mask_id(self.mask_id)

    # -- randomness and denominators ------------------------------------------------------

    def plan(self, layout: BlockLayout, keys: jax.Array, step: jax.Array | int = 0) -> Plan:
        config = self.config
        corruption = corrupt(
            layout,
            keys,
            alignment=config.alignment,
            canvas=config.canvas,
            min_noise=config.min_noise,
            mask_id=self.mask_id,
            antithetic=config.antithetic,
        )
        schedule = ramp(step, config.ramp_steps)
        length = layout.tokens.shape[1]
        commit_draws = jax.vmap(lambda key: jax.random.uniform(key, (length,)))(_fold(keys, 1))
        commit = corruption.corruption_mask & (commit_draws < config.k_frac * schedule)
        order = _coordination_order(layout, corruption, _fold(keys, 2), config.group)
        return Plan(corruption, commit, order, schedule)

    def term_names(self) -> tuple[str, ...]:
        if self.config.kind == "cmd":
            return ("mdlm", "self_corrupted", "coordination")
        return (self.config.kind,)

    def denominators(self, layout: BlockLayout, plan: Plan) -> dict[str, jax.Array]:
        completion = jnp.sum(layout.completion_mask, dtype=jnp.float32)
        out = {}
        for name in self.term_names():
            if name == "block_ce":
                out[name] = f32_sum(loss_weights(layout), plan.corruption.target_mask)
            elif name == "coordination":
                out[name] = jnp.sum(plan.coordination_order >= 0, dtype=jnp.float32)
            else:
                out[name] = completion
        return out

    def coefficients(self, plan: Plan) -> dict[str, jax.Array | float]:
        config = self.config
        if config.kind != "cmd":
            return {config.kind: 1.0}
        return {
            "mdlm": 1.0,
            "self_corrupted": config.alpha,
            "coordination": config.beta * plan.ramp,
        }

    # -- model-dependent sums --------------------------------------------------------------

    def _hidden(self, model, layout, canvas):
        return target_hidden(
            model, layout, canvas, alignment=self.config.alignment, context=self.config.context
        )

    def _log_probs(self, model, layout, canvas):
        hidden = self._hidden(model, layout, canvas)
        return token_log_probs(
            model, hidden, layout.tokens, mask_id=self.mask_id, vocab_chunk=self.vocab_chunk
        )

    def sums(
        self, model: Transformer, layout: BlockLayout, plan: Plan, keys: jax.Array
    ) -> dict[str, jax.Array]:
        out = {}
        for name in self.term_names():
            if name == "block_ce":
                out[name] = self._block_ce(model, layout, plan)
            elif name == "mdlm":
                out[name] = self._mdlm(model, layout, plan.corruption)[0]
            elif name == "self_corrupted":
                out[name] = self._self_corrupted(model, layout, plan, _fold(keys, 3))
            else:
                out[name] = self._coordination(model, layout, plan, _fold(keys, 4))
        return out

    def _block_ce(self, model, layout, plan):
        corruption = plan.corruption
        logp = self._log_probs(model, layout, corruption.canvas)
        return f32_sum(-logp * loss_weights(layout), corruption.target_mask)

    def _mdlm(self, model, layout, corruption, canvas=None, scored=None):
        canvas = corruption.canvas if canvas is None else canvas
        scored = corruption.target_mask if scored is None else scored
        logp = self._log_probs(model, layout, canvas)
        weight = jnp.where(corruption.corruption_mask, 1.0 / corruption.noise, 1.0)
        return f32_sum(-logp * weight, scored), logp

    def _self_corrupted(self, model, layout, plan, keys):
        corruption = plan.corruption
        hidden = jax.lax.stop_gradient(self._hidden(model, layout, corruption.canvas))
        samples = _sample(model, hidden, keys, self.mask_id)
        canvas = jnp.where(plan.commit_mask, samples, corruption.canvas)
        remaining = corruption.target_mask & ~plan.commit_mask
        main, logp = self._mdlm(model, layout, corruption, canvas=canvas, scored=remaining)
        repair = f32_sum(-logp, plan.commit_mask)
        return main + self.config.repair_weight * repair

    def _coordination(self, model, layout, plan, keys):
        targets = coordination_targets(
            model, layout, plan, keys, objective=self
        )  # no gradient: a sequential decode
        order = plan.coordination_order
        hidden = self._hidden(model, layout, plan.corruption.canvas)
        rows = jnp.arange(order.shape[0])[:, None]
        picked = hidden[rows, jnp.maximum(order, 0)]
        logp = token_log_probs(
            model, picked, targets, mask_id=self.mask_id, vocab_chunk=self.vocab_chunk
        )
        return f32_sum(-logp, order >= 0)


def coordination_targets(
    model: Transformer, layout: BlockLayout, plan: Plan, keys: jax.Array, *, objective: Objective
) -> jax.Array:
    """The joint sample ``[B, G]`` at ``plan.coordination_order``: slot i is sampled from the
    model given the corrupted canvas with picks 0..i-1 filled in (no gradient)."""
    order = plan.coordination_order
    batch, group = order.shape
    rows = jnp.arange(batch)

    def body(index, carry):
        canvas, picks = carry
        hidden = jax.lax.stop_gradient(objective._hidden(model, layout, canvas))
        slot = order[:, index]
        row_hidden = hidden[rows, jnp.maximum(slot, 0)][:, None]  # [B, 1, d]
        step_keys = jax.vmap(lambda key: jax.random.fold_in(key, index))(keys)
        token = _sample(model, row_hidden, step_keys, objective.mask_id)[:, 0]
        live = slot >= 0
        canvas = canvas.at[rows, jnp.maximum(slot, 0)].set(
            jnp.where(live, token, canvas[rows, jnp.maximum(slot, 0)])
        )
        return canvas, picks.at[:, index].set(jnp.where(live, token, 0))

    _, picks = jax.lax.fori_loop(
        0, group, body, (plan.corruption.canvas, jnp.zeros((batch, group), jnp.int32))
    )
    return jax.lax.stop_gradient(picks)


# ---- causal teacher ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """Next-token cross-entropy on the completion for a causal model (the teacher): the
    logits at logical position p-1 predict token p; weighted by ``loss_weights``. Same
    plan / denominators / sums interface as :class:`Objective` (its plan is empty)."""

    vocab_chunk: int | None = 4096

    def plan(self, layout: BlockLayout, keys: jax.Array, step: jax.Array | int = 0) -> None:
        return None

    def term_names(self) -> tuple[str, ...]:
        return ("causal_ce",)

    def _scored(self, layout: BlockLayout) -> jax.Array:
        sources = align.source_slots(layout.positions, layout.segment_ids, "shifted")
        return layout.completion_mask & (sources >= 0), sources

    def denominators(self, layout: BlockLayout, plan: None) -> dict[str, jax.Array]:
        scored, _ = self._scored(layout)
        return {"causal_ce": f32_sum(loss_weights(layout), scored)}

    def coefficients(self, plan: None) -> dict[str, float]:
        return {"causal_ce": 1.0}

    def sums(self, model: Transformer, layout: BlockLayout, plan: None, keys: jax.Array):
        scored, sources = self._scored(layout)
        hidden = model.hidden_states(layout.tokens, layout.positions, layout.segment_ids)
        logp = gathered_log_probs(
            align.gather_sources(hidden, sources),
            model.output_embedding(),
            layout.tokens,
            vocab_chunk=self.vocab_chunk,
        )
        return {"causal_ce": f32_sum(-logp * loss_weights(layout), scored)}


# ---- evaluation -------------------------------------------------------------------------


def nll_bound(
    model: Transformer,
    layout: BlockLayout,
    keys: jax.Array,
    *,
    alignment: str,
    canvas: str,
    mask_id: int,
    context: str = "clean",
    min_noise: float = 1e-3,
) -> tuple[jax.Array, jax.Array]:
    """One Monte-Carlo sample of the MDLM bound on the completion's negative log-likelihood:
    ``(nats, tokens)``. Average several samples (different keys); divide by
    ``tokens * ln 2`` for bits per token (= bits per character with a character tokenizer).
    The bound is an upper bound in expectation (``min_noise`` small truncates the time
    integral near 0, where the weight 1/t meets almost no masked tokens)."""
    config = ObjectiveConfig(
        kind="mdlm", alignment=alignment, canvas=canvas, context=context, min_noise=min_noise
    )
    objective = Objective(config, mask_id)
    plan = objective.plan(layout, keys)
    total, _ = objective._mdlm(model, layout, plan.corruption)
    return total, jnp.sum(layout.completion_mask, dtype=jnp.float32)


def bits(nats: float, count: float) -> float:
    """Nats summed over ``count`` tokens, as bits per token."""
    return nats / (count * math.log(2.0)) if count else float("nan")


__all__ = [
    "OBJECTIVES",
    "Objective",
    "Plan",
    "bits",
    "CausalLM",
    "combine",
    "coordination_targets",
    "loss_weights",
    "nll_bound",
    "ramp",
    "safe_ratio",
    "target_hidden",
    "token_log_probs",
]
