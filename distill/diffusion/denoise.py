"""Low-confidence block denoising with a clean-prefix KV cache, recording a replayable trace.

The denoiser walks the physical windows of a :class:`~distill.diffusion.layout.BlockLayout`
(each window is one logical block of every row). For each window it repeats *steps*: one
forward of the window's canvas against the cache of the clean earlier blocks, a proposal for
every pending (still masked) completion slot, a score, and a commit rule that picks which
proposals become final. When no slot of the window is pending, the clean block is written to
the cache with one more forward, whose logits at the block's last slot also give the next
block's anchor under the ``shifted`` alignment.

Semantics (DESIGN section 5):

- Proposals are categorical samples of ``softmax(logits / temperature)`` with the mask id's
  logit at -inf (``greedy``: argmax, and log-probs at temperature 1). ``action_logps`` is the
  log-probability of the committed token under that same distribution, at the step it was
  committed.
- ``threshold`` rule: every pending slot whose score is >= ``threshold`` commits; when none
  clears, the single best one does (ties to the lowest slot), keeping its sampled token.
  ``threshold = 1`` means "never clears": exactly one token per step, even where a
  confidence rounds to exactly 1.0 in float32 (the rule is ``score >= threshold`` only for
  ``threshold < 1``). ``threshold = 0`` commits the whole block in one step. Score
  ``max_prob`` (the default: the slot's largest probability, so the commit order does not
  depend on the sampled value) or
  ``sampled_prob`` (the probability of the sampled token, the research note's rule: the
  sampled value then steers the commit order, which is known to collapse diversity).
- ``schedule`` rule: ``k = ceil(pending / steps_left)`` slots per step, chosen by score:
  ``confidence`` (max prob), ``random``, ``entropy`` (lowest first) or ``margin``. The step
  budget per block is ``ceil(schedule_steps * block_size / completion_length)``.
- ``planner`` rule (the student's commit policy, :mod:`distill.models.planner`): each
  pending slot commits with probability ``sigmoid(z)``, ``z`` the planner's logit of the
  hidden state its proposal is read from, decided by a Bernoulli draw ``u < sigmoid(z)``
  with ``u`` uniform from the row's step key. Forced progress: when a row draws no commit,
  its pending slot with the largest ``z`` (ties to the lowest slot) commits anyway. The
  trace records every draw: ``decision_logps[b, p, j]`` is the log-probability of slot
  ``p``'s draw at the ``j``-th step of its block (``log sigmoid(z)`` for a commit draw,
  ``log sigmoid(-z)`` for a wait draw; 0 where the slot was not pending), and ``forced``
  marks the slots committed by forced progress: their draw at their commit step was a wait,
  recorded as ``log sigmoid(-z)``. The draws are the action, the forced commit a
  deterministic function of them, so these log-probs are exact likelihoods of what was
  sampled (docs/opd.md). A ``shifted`` anchor step has no decisions.
- ``shifted`` alignment: logits at the previous logical position predict a token. A block's
  first slot (anchor) is committed first, as its own action step, from the clean previous
  block's last logits (the prefill for the first block); it is never masked in the input.
- Step counters are per row and advance only when that row commits. Each row draws its
  randomness from its own key folded with its own step counter, so rows are independent
  and a row's trace does not depend on the rest of the batch.
- ``forwards`` per row counts the forwards its actions depended on: each denoising step in
  which the row had a pending slot, plus one per anchor (the clean-block forward it reads).
  Under ``same_position`` the cache-writing forward of a block is not counted: nothing is
  sampled from it and it can be fused with the next block's first step.
- ``stop_when_done``: once a row has committed a stop token, later blocks are not generated
  for it (its pending slots there become padding in the trace).

Everything after layout construction runs inside one ``jax.jit`` (a ``fori_loop`` over
windows and a ``while_loop`` over steps): no host round-trip per step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.config import (
    Alignment,
    CommitRule,
    Confidence,
    RolloutConfig,
    ScheduleStrategy,
    check_contract,
)
from distill.diffusion.layout import BlockLayout, build_rollout_layout
from distill.models.kv_cache import KVCache
from distill.models.logprobs import tempered_log_softmax
from distill.models.transformer import Transformer
from distill.tokenizer import SpecialIds

Mode = Literal["train", "eval"]
MODES: tuple[Mode, ...] = ("train", "eval")
NEG_INF = -jnp.inf


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Everything that determines which actions a rollout takes (hashable, static).

    Validated on construction (also by ``dataclasses.replace`` and when decoded from another
    process), since :func:`denoise` and replay branch on these values without re-checking:
    the choice fields must be the config's ``Literal`` values, ``threshold`` in [0, 1],
    ``temperature`` finite and > 0 (greedy rollouts record log-probs at 1.0),
    ``completion_length`` >= 1, ``schedule_steps`` >= 1 and set for the schedule rule, ids
    >= 0 and the stop ids without the mask id.
    """

    alignment: str
    commit_rule: str
    threshold: float
    confidence: str
    schedule_steps: int | None
    strategy: str
    temperature: float
    greedy: bool
    stop_when_done: bool
    completion_length: int
    mask_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        def fail(field: str, requirement: str, received: Any) -> ValueError:
            return ValueError(f"`settings.{field}` must {requirement}; received {received!r}")

        choices = (
            ("alignment", Alignment),
            ("commit_rule", CommitRule),
            ("confidence", Confidence),
            ("strategy", ScheduleStrategy),
        )
        for field, literal in choices:
            if getattr(self, field) not in get_args(literal):
                raise fail(field, f"be one of {get_args(literal)}", getattr(self, field))
        if not (_is_real(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise fail("threshold", "be a number in [0, 1]", self.threshold)
        temperature = self.temperature
        if not (_is_real(temperature) and math.isfinite(temperature) and temperature > 0):
            raise fail("temperature", "be a finite number > 0", temperature)
        for field in ("greedy", "stop_when_done"):
            if not isinstance(getattr(self, field), bool):
                raise fail(field, "be a bool", getattr(self, field))
        if not (_is_int(self.completion_length) and self.completion_length >= 1):
            raise fail("completion_length", "be an integer >= 1", self.completion_length)
        if self.schedule_steps is not None and not (
            _is_int(self.schedule_steps) and self.schedule_steps >= 1
        ):
            raise fail("schedule_steps", "be an integer >= 1 or None", self.schedule_steps)
        if self.commit_rule == "schedule" and self.schedule_steps is None:
            raise fail("schedule_steps", "be set when commit_rule is 'schedule'", None)
        for field in ("mask_id", "pad_id"):
            if not (_is_int(getattr(self, field)) and getattr(self, field) >= 0):
                raise fail(field, "be a token id >= 0", getattr(self, field))
        if not isinstance(self.stop_ids, tuple) or not all(
            _is_int(token) and token >= 0 for token in self.stop_ids
        ):
            raise fail("stop_ids", "be a tuple of token ids >= 0", self.stop_ids)
        if self.mask_id in self.stop_ids:
            raise fail("stop_ids", f"not contain the mask id {self.mask_id}", self.stop_ids)

    @classmethod
    def from_config(cls, rollout: RolloutConfig, special: SpecialIds) -> SamplingSettings:
        check_contract(rollout.alignment, rollout.canvas, prefix="rollout.")
        if rollout.max_completion_length is None:
            raise ValueError(
                "`rollout.max_completion_length` must be set to build sampling settings "
                "(a job fills it in from its tasks); received None"
            )
        return cls(
            alignment=rollout.alignment,
            commit_rule=rollout.commit_rule,
            threshold=rollout.threshold,
            confidence=rollout.confidence,
            schedule_steps=rollout.schedule_steps,
            strategy=rollout.strategy,
            temperature=1.0 if rollout.greedy else rollout.temperature,
            greedy=rollout.greedy,
            stop_when_done=rollout.stop_when_done,
            completion_length=rollout.max_completion_length,
            mask_id=special.mask_id,
            pad_id=special.pad_id,
            stop_ids=tuple(special.stop_ids),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trace:
    """A rollout and everything needed to replay it exactly.

    ``[B, L]``: ``tokens`` (final canvas), ``positions``, ``segment_ids`` (0 = padding,
    including completion slots never generated because the row had stopped),
    ``prompt_mask``, ``completion_mask`` (generated slots), ``action_steps`` (int32, the
    row's step at which the slot was committed; -1 outside the completion),
    ``action_logps`` (float32). ``forwards`` ``[B]`` int32.

    Planner rule only (None otherwise): ``decision_logps`` ``[B, L, block_size]`` float32
    (``[b, p, j]``: log-prob of slot p's commit draw at the j-th step of its block, 0 where
    it was not pending) and ``forced`` ``[B, L]`` bool (committed by forced progress).
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    prompt_mask: jax.Array
    completion_mask: jax.Array
    action_steps: jax.Array
    action_logps: jax.Array
    forwards: jax.Array
    settings: SamplingSettings = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})
    decision_logps: jax.Array | None = None
    forced: jax.Array | None = None

    def tokens_per_forward(self) -> float:
        """Committed completion tokens per counted forward, over the whole batch."""
        committed = int(np.asarray(self.completion_mask).sum())
        return committed / max(int(np.asarray(self.forwards).sum()), 1)

    def completions(self) -> list[list[int]]:
        """Each row's generated ids in logical order, cut after the first stop token
        (the stop token itself included)."""
        tokens, mask = np.asarray(self.tokens), np.asarray(self.completion_mask)
        stops = set(self.settings.stop_ids)
        out = []
        for row in range(tokens.shape[0]):
            ids = tokens[row][mask[row]].tolist()
            cut = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
            out.append(ids[:cut])
        return out

    def stopped(self) -> np.ndarray:
        """``[B]`` bool: whether each row committed a stop token."""
        tokens, mask = np.asarray(self.tokens), np.asarray(self.completion_mask)
        return (np.isin(tokens, self.settings.stop_ids) & mask).any(axis=1)


def row_keys(seed: int, global_step: int, mode: Mode, row_ids: Sequence[int]) -> jax.Array:
    """One key per row from (seed, global step, mode, row id): eval never touches the
    training stream, and a resumed job regenerates identical rollouts."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}; received {mode!r}")
    if global_step < 0:
        raise ValueError(f"`global_step` must be >= 0; received {global_step}")
    base = jax.random.fold_in(jax.random.key(seed), global_step)
    base = jax.random.fold_in(base, MODES.index(mode))
    ids = jnp.asarray(np.asarray(row_ids, np.uint32))
    return jax.vmap(lambda row: jax.random.fold_in(base, row))(ids)


def _tempered_log_probs(logits: jax.Array, settings: SamplingSettings) -> jax.Array:
    # Normalized as replay gathers (max-shifted before the temperature), so the recorded
    # action log-probs replay to float32 precision at any logit scale.
    return tempered_log_softmax(logits, settings.temperature, settings.mask_id)


def _propose(
    log_probs: jax.Array, keys: jax.Array, settings: SamplingSettings
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per slot: proposal ids, their log-probs, and commit scores. ``log_probs`` [B, K, V];
    ``keys`` [B] (this step's key of each row)."""
    sample_keys, score_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    if settings.greedy:
        proposals = jnp.argmax(log_probs, axis=-1)
    else:
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, log_probs.shape[1:]))(sample_keys)
        proposals = jnp.argmax(log_probs + gumbel, axis=-1)
    chosen = jnp.take_along_axis(log_probs, proposals[..., None], axis=-1)[..., 0]
    if settings.commit_rule == "planner":
        # The planner's Bernoulli draws read these uniforms (``u < sigmoid(z)``).
        score = jax.vmap(lambda key: jax.random.uniform(key, log_probs.shape[1:2]))(score_keys)
        return proposals.astype(jnp.int32), chosen, score
    probs = jnp.exp(log_probs)
    if settings.commit_rule == "threshold":
        score = chosen if settings.confidence == "sampled_prob" else log_probs.max(-1)
        score = jnp.exp(score)
    elif settings.strategy == "confidence":
        score = probs.max(-1)
    elif settings.strategy == "random":
        score = jax.vmap(lambda key: jax.random.uniform(key, log_probs.shape[1:2]))(score_keys)
    elif settings.strategy == "entropy":
        score = jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)  # -entropy
    else:  # margin
        top2 = jax.lax.top_k(probs, 2)[0]
        score = top2[..., 0] - top2[..., 1]
    return proposals.astype(jnp.int32), chosen, score


def _select(
    score: jax.Array, pending: jax.Array, steps_left: jax.Array, settings: SamplingSettings
) -> jax.Array:
    """Which pending slots commit this step ([B, K] bool)."""
    masked_score = jnp.where(pending, score, NEG_INF)
    if settings.commit_rule == "threshold":
        clears = pending & (score >= settings.threshold) & (settings.threshold < 1.0)
        best = jax.nn.one_hot(jnp.argmax(masked_score, axis=-1), score.shape[-1], dtype=bool)
        forced = best & pending & ~clears.any(-1, keepdims=True)
        return clears | forced
    n_pending = pending.sum(-1)
    k = -(-n_pending // jnp.maximum(steps_left, 1))  # ceil
    order = jnp.argsort(-masked_score, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return pending & (rank < k[:, None])


def _plan(
    commit_logits: jax.Array, uniforms: jax.Array, pending: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Planner decisions of one step (``[B, K]`` each): which slots commit, which of them
    were forced, and every pending slot's draw log-prob (0 elsewhere)."""
    drawn = pending & (uniforms < jax.nn.sigmoid(commit_logits))
    best = jnp.argmax(jnp.where(pending, commit_logits, NEG_INF), axis=-1)
    none = pending.any(-1) & ~drawn.any(-1)
    forced = jax.nn.one_hot(best, pending.shape[-1], dtype=bool) & pending & none[:, None]
    draw_logps = jnp.where(
        drawn, jax.nn.log_sigmoid(commit_logits), jax.nn.log_sigmoid(-commit_logits)
    )
    return drawn | forced, forced, jnp.where(pending, draw_logps, 0.0)


def _steps_per_block(settings: SamplingSettings, block_size: int) -> int:
    if settings.commit_rule != "schedule":
        return block_size
    budget = settings.schedule_steps * block_size / settings.completion_length
    return max(1, math.ceil(budget - 1e-9))


def _window(array: jax.Array, window: jax.Array, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(array, window * size, size, axis=1)


def _put_window(array: jax.Array, value: jax.Array, window: jax.Array, size: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(array, value, window * size, axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "prefix_cache"))
def _denoise(
    graphdef,
    state,
    layout: BlockLayout,
    keys: jax.Array,
    settings: SamplingSettings,
    prefix_cache: bool = True,
):
    model: Transformer = nnx.merge(graphdef, state)
    size, first = layout.block_size, layout.first_window
    batch = layout.tokens.shape[0]
    shifted = settings.alignment == "shifted"
    planner = settings.commit_rule == "planner"
    steps_per_block = _steps_per_block(settings, size)
    stop_ids = jnp.asarray(settings.stop_ids, jnp.int32)

    cache = KVCache.init(model.config, batch, layout.tokens.shape[1])
    prefix = first * size
    if prefix:
        prefill_logits, cache = model.decode(
            layout.tokens[:, :prefix],
            layout.positions[:, :prefix],
            layout.segment_ids[:, :prefix],
            cache,
            write_index=0,
        )
        last_logits = prefill_logits[:, -1]
    else:
        last_logits = jnp.zeros((batch, model.config.vocab_size), jnp.float32)

    def step_key(counter: jax.Array) -> jax.Array:
        return jax.vmap(jax.random.fold_in)(keys, counter)

    def window_body(window, carry):
        canvas, steps, logps, counter, forwards, stopped, cache, last_logits = carry[:8]
        decisions, forced = carry[8:] if planner else (None, None)
        w_tokens = _window(canvas, window, size)
        w_pos = _window(layout.positions, window, size)
        w_seg = _window(layout.segment_ids, window, size)
        w_completion = _window(layout.completion_mask, window, size) & ~stopped[:, None]
        w_steps = _window(steps, window, size)
        w_logps = _window(logps, window, size)

        if shifted:
            # The anchor: one action step read from the clean previous block's last logits.
            is_anchor = w_completion[:, 0]
            anchor_lp = _tempered_log_probs(last_logits, settings)[:, None]
            ids, lp, _ = _propose(anchor_lp, step_key(counter), settings)
            w_tokens = w_tokens.at[:, 0].set(jnp.where(is_anchor, ids[:, 0], w_tokens[:, 0]))
            w_steps = w_steps.at[:, 0].set(jnp.where(is_anchor, counter, w_steps[:, 0]))
            w_logps = w_logps.at[:, 0].set(jnp.where(is_anchor, lp[:, 0], w_logps[:, 0]))
            counter = counter + is_anchor
            forwards = forwards + is_anchor
        # The step index inside this block where the row's denoising steps start.
        first_offset = is_anchor.astype(jnp.int32) if shifted else jnp.zeros_like(counter)

        def window_hidden(w_tokens):
            if prefix_cache:
                return model.decode_hidden(w_tokens, w_pos, w_seg, cache)[0]
            # Reference path: recompute the whole row every step (same logits, more work).
            full = _put_window(canvas, w_tokens, window, size)
            hidden = model.hidden_states(full, layout.positions, layout.segment_ids)
            return _window(hidden, window, size)

        def window_logits(w_tokens):
            if prefix_cache:
                return model.decode(w_tokens, w_pos, w_seg, cache)[0]
            return model.logits(window_hidden(w_tokens))

        def pending_of(w_steps):
            return w_completion & (w_steps < 0)

        def step_cond(state):
            w_tokens, w_steps, w_logps, counter, forwards, taken = state[:6]
            return pending_of(w_steps).any() & (taken < size)

        def step_body(state):
            w_tokens, w_steps, w_logps, counter, forwards, taken = state[:6]
            pending = pending_of(w_steps)
            active = pending.any(-1)
            if planner:
                hidden = window_hidden(w_tokens)
                logits = model.logits(hidden)
                commit_logits = model.commit_logits(hidden)
            else:
                logits = window_logits(w_tokens)
            if shifted:
                logits = jnp.concatenate([last_logits[:, None], logits[:, :-1]], axis=1)
            log_probs = _tempered_log_probs(logits, settings)
            ids, lp, score = _propose(log_probs, step_key(counter), settings)
            if planner:
                if shifted:  # slot k's proposal (and decision) reads the state at k - 1
                    commit_logits = jnp.concatenate(
                        [jnp.zeros_like(commit_logits[:, :1]), commit_logits[:, :-1]], axis=1
                    )
                commit, forced_now, draw_logps = _plan(commit_logits, score, pending)
                w_decisions, w_forced = state[6:]
                column = jax.nn.one_hot(first_offset + taken, size, dtype=bool)[:, None, :]
                w_decisions = jnp.where(
                    column & pending[..., None], draw_logps[..., None], w_decisions
                )
                extra = (w_decisions, w_forced | forced_now)
            else:
                commit = _select(score, pending, steps_per_block - taken, settings)
                extra = ()
            w_tokens = jnp.where(commit, ids, w_tokens)
            w_steps = jnp.where(commit, counter[:, None], w_steps)
            w_logps = jnp.where(commit, lp, w_logps)
            counter = counter + commit.any(-1)
            return (w_tokens, w_steps, w_logps, counter, forwards + active, taken + 1, *extra)

        extra = ()
        if planner:
            extra = (_window(decisions, window, size), _window(forced, window, size))
        w_tokens, w_steps, w_logps, counter, forwards, _, *extra = jax.lax.while_loop(
            step_cond,
            step_body,
            (w_tokens, w_steps, w_logps, counter, forwards, jnp.zeros((), jnp.int32), *extra),
        )
        if planner:
            extra = (
                _put_window(decisions, extra[0], window, size),
                _put_window(forced, extra[1], window, size),
            )
        # The window is clean now: cache it; its last logits seed the next anchor.
        clean_logits, cache = model.decode(w_tokens, w_pos, w_seg, cache, write_index=window * size)
        stopped = stopped | (w_completion & jnp.isin(w_tokens, stop_ids)).any(-1)
        return (
            _put_window(canvas, w_tokens, window, size),
            _put_window(steps, w_steps, window, size),
            _put_window(logps, w_logps, window, size),
            counter,
            forwards,
            stopped if settings.stop_when_done else jnp.zeros_like(stopped),
            cache,
            clean_logits[:, -1],
            *extra,
        )

    planner_init = ()
    if planner:
        planner_init = (
            jnp.zeros((*layout.tokens.shape, size), jnp.float32),
            jnp.zeros(layout.tokens.shape, bool),
        )
    init = (
        layout.tokens,
        jnp.full(layout.tokens.shape, -1, jnp.int32),
        jnp.zeros(layout.tokens.shape, jnp.float32),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch,), bool),
        cache,
        last_logits,
        *planner_init,
    )
    canvas, steps, logps, _, forwards, _, _, _, *planned = jax.lax.fori_loop(
        first, layout.num_windows, window_body, init
    )
    generated = layout.completion_mask & (steps >= 0)
    dropped = layout.completion_mask & ~generated  # only after a stop, with stop_when_done
    return Trace(
        tokens=jnp.where(dropped, settings.pad_id, canvas),
        positions=jnp.where(dropped, 0, layout.positions),
        segment_ids=jnp.where(dropped, 0, layout.segment_ids),
        prompt_mask=layout.prompt_mask,
        completion_mask=generated,
        action_steps=steps,
        action_logps=logps,
        forwards=forwards,
        settings=settings,
        block_size=size,
        decision_logps=planned[0] if planner else None,
        forced=planned[1] if planner else None,
    )


def denoise(
    model: Transformer,
    layout: BlockLayout,
    keys: jax.Array,
    settings: SamplingSettings,
    *,
    prefix_cache: bool = True,
) -> Trace:
    """Generate every completion slot of ``layout`` and return the trace.

    ``model`` must be a ``block_diffusion`` transformer whose ``block_size`` equals the
    layout's; ``keys`` holds one PRNG key per row (see :func:`row_keys`).
    ``prefix_cache=False`` recomputes the whole row at every step instead of attending to
    cached clean blocks: the same trace at far higher cost (a reference and a baseline).
    """
    config = model.config
    if config.attention_type != "block_diffusion":
        raise ValueError(
            f"`model.attention_type` must be 'block_diffusion'; received {config.attention_type!r}"
        )
    if config.block_size != layout.block_size:
        raise ValueError(
            f"`layout.block_size` must equal model.block_size={config.block_size}; "
            f"received {layout.block_size}"
        )
    if keys.shape != (layout.tokens.shape[0],):
        raise ValueError(
            f"`keys` must hold one key per row ({layout.tokens.shape[0]}); received {keys.shape}"
        )
    for name, value in (("mask_id", settings.mask_id), ("pad_id", settings.pad_id)):
        if not 0 <= value < config.vocab_size:
            raise ValueError(f"`settings.{name}` must be in [0, {config.vocab_size}); {value}")
    if settings.mask_id in settings.stop_ids:  # also refused on construction
        raise ValueError(
            f"`settings.stop_ids` must not contain the mask id {settings.mask_id}; "
            f"received {settings.stop_ids}"
        )
    if settings.commit_rule == "planner" and model.planner is None:
        raise ValueError(
            "`model.config.planner_hidden` must be set for commit_rule 'planner' (the "
            "student's commit policy head); received None"
        )
    if settings.alignment == "shifted" and layout.block_size < 2:
        raise ValueError(
            "`layout.block_size` must be >= 2 with the shifted + seed_and_mask contract (a "
            f"block of 1 is all anchor: nothing is ever corrupted); received {layout.block_size}"
        )
    graphdef, state = nnx.split(model)
    return _denoise(graphdef, state, layout, keys, settings, prefix_cache)


def rollout(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    *,
    seed: int,
    global_step: int,
    mode: Mode = "train",
    row_ids: Sequence[int] | None = None,
    prefix_cache: bool = True,
    completion_lengths: Sequence[int] | None = None,
) -> Trace:
    """Lay out ``prompts`` and denoise them (see :func:`denoise`). ``completion_lengths``
    optionally caps each row's completion below ``settings.completion_length``."""
    layout = build_rollout_layout(
        prompts,
        completion_length=settings.completion_length,
        completion_lengths=completion_lengths,
        block_size=model.config.block_size,
        pad_id=settings.pad_id,
        mask_id=settings.mask_id,
        vocab_size=model.config.vocab_size,
    )
    ids = range(len(prompts)) if row_ids is None else row_ids
    if len(ids) != len(prompts):
        raise ValueError(f"`row_ids` must have one id per prompt; received {len(ids)}")
    keys = row_keys(seed, global_step, mode, ids)
    return denoise(model, layout, keys, settings, prefix_cache=prefix_cache)
