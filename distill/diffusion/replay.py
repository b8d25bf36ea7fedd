"""Exact replay of a rollout trace: the log-probability of every recorded action under any
parameters (live, old or reference student), differentiable.

For every recorded step s of a row, the canvas the student saw is
``where(completion & (action_steps >= s), mask, tokens)`` (prompt clean); the action's
log-prob is read where the rollout read it (the slot itself under ``same_position``; the
previous logical position under ``shifted``) at the rollout's temperature with the mask id
excluded.

- :func:`replay_per_step`: the reference. One full forward per distinct step
  (``lax.scan`` with a rematerialized body).
- :func:`replay_packed`: the fast path. The clean row once, then one canvas chunk per
  (row, step) holding that step's canvas of its block (DESIGN section 4). ``dense=True``
  runs the packed row with the dense mask (reference for the packing itself); the default
  attends each chunk to the cached clean keys (block-sparse), optionally in groups of
  ``chunks_per_forward`` chunks to bound memory.
- :func:`replay_completion`: the same in completion space (:class:`CompletionReplay`),
  optionally with the full sampling distributions for the full-vocabulary / top-k losses.

Planner traces (``commit_rule: planner``) also replay their commit decisions:
:func:`replay_decisions_per_step` (reference) and :func:`replay_decisions_packed` (the
packed chunks; ``replay_completion(..., decisions=True)`` in completion space) rebuild the
canvas of every step, read the planner's logit where the rollout read it and return every
draw's log-prob as the trace's ``decision_logps`` ``[B, L, block_size]``
(:func:`decision_layout` says which draws exist and which committed).

Log-probs are gathered with a chunked log-sum-exp over the vocabulary
(:func:`~distill.models.logprobs.gathered_log_probs`), never as ``[B, L, V]`` logits.
Both paths return ``[B, L]`` float32 with zeros outside the completion.

The static step count (``num_steps`` / ``num_chunks``) must cover every recorded step
(:func:`num_steps_bucket`). Where ``trace.action_steps`` is concrete (an eager call, or a
trace closed over as a constant under ``jit``) a smaller count raises, naming the count the
trace needs. Where it is traced (the trace is a ``jit`` argument, as in the OPD update) it
cannot be read: actions at steps the count does not cover then replay as NaN in both paths,
so a loss built on them is non-finite rather than silently missing those actions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distill.diffusion.denoise import Trace
from distill.models.logprobs import gathered_log_probs, tempered_log_softmax
from distill.models.masks import pack_canvas_chunks
from distill.models.transformer import Transformer


class TraceError(ValueError):
    """A trace breaks the replay contract; the message names the field and the row."""


def validate_trace(trace: Trace, vocab_size: int | None = None) -> None:
    """Fail closed unless ``trace`` can be replayed exactly (host-side, numpy).

    Checks: one segment per row with logical positions 0..n-1 in slot order, windows aligned
    to blocks, a non-empty prompt followed by a non-empty contiguous completion, action
    steps exactly on the completion, each step inside one block, steps 0..S-1 all used,
    blocks committed in order (every step of a block before any step of a later block), no
    mask id left in the completion, finite action log-probs, ids inside the vocabulary.
    """
    tokens = np.asarray(trace.tokens)
    arrays = {
        "positions": np.asarray(trace.positions),
        "segment_ids": np.asarray(trace.segment_ids),
        "prompt_mask": np.asarray(trace.prompt_mask),
        "completion_mask": np.asarray(trace.completion_mask),
        "action_steps": np.asarray(trace.action_steps),
        "action_logps": np.asarray(trace.action_logps),
    }
    if tokens.ndim != 2:
        raise TraceError(f"`trace.tokens` must be [B, L]; received shape {tokens.shape}")
    for name, array in arrays.items():
        if array.shape != tokens.shape:
            raise TraceError(f"`trace.{name}` must have shape {tokens.shape}; got {array.shape}")
    size, mask_id = trace.block_size, trace.settings.mask_id
    if tokens.shape[1] % size:
        raise TraceError(
            f"`trace.tokens` must span whole blocks of {size}; received length {tokens.shape[1]}"
        )
    positions, segments = arrays["positions"], arrays["segment_ids"]
    prompt, completion = arrays["prompt_mask"], arrays["completion_mask"]
    steps, logps = arrays["action_steps"], arrays["action_logps"]
    for row in range(tokens.shape[0]):
        valid = segments[row] != 0
        slots = np.flatnonzero(valid)

        def fail(field: str, requirement: str, received: object, row: int = row) -> TraceError:
            return TraceError(f"`trace.{field}` must {requirement} (row {row}); got {received}")

        if len(np.unique(segments[row][valid])) != 1:
            raise fail("segment_ids", "hold one segment per row", np.unique(segments[row]))
        if not np.array_equal(positions[row][slots], np.arange(len(slots))) or not np.all(
            np.diff(slots) == 1
        ):
            raise fail("positions", "be 0..n-1 on consecutive slots", positions[row][slots])
        if (slots[0] - positions[row][slots[0]]) % size:
            raise fail("positions", f"align blocks of {size} to slot windows", slots[0])
        if (prompt[row] & ~valid).any() or (completion[row] & ~valid).any():
            raise fail("segment_ids", "be non-zero on prompt and completion slots", "padding")
        if (prompt[row] & completion[row]).any() or not np.array_equal(
            prompt[row] | completion[row], valid
        ):
            raise fail("completion_mask", "split valid slots into prompt and completion", "overlap")
        if not prompt[row].any():
            raise fail("prompt_mask", "mark a non-empty prompt", "no prompt")
        if not completion[row].any():
            raise fail("completion_mask", "mark a non-empty completion", "no completion")
        done = np.flatnonzero(completion[row])
        if not np.all(np.diff(done) == 1) or prompt[row][done[0] :].any():
            raise fail("completion_mask", "be one contiguous suffix after the prompt", done)
        if not np.array_equal(steps[row] >= 0, completion[row]):
            raise fail("action_steps", "be >= 0 exactly on the completion", steps[row])
        used = np.unique(steps[row][completion[row]])
        if not np.array_equal(used, np.arange(len(used))):
            raise fail("action_steps", "use every step 0..S-1", used)
        blocks = []  # the logical block of each step
        for step in used:
            committed = np.flatnonzero(steps[row] == step)
            if len(np.unique(committed // size)) != 1:
                raise fail("action_steps", "commit each step inside one block", step)
            blocks.append(int(positions[row][committed[0]]) // size)
        # Replay scores block b against clean blocks < b: exact only if they were all
        # committed before block b's first step.
        late = np.flatnonzero(np.diff(blocks) < 0)
        if late.size:
            step = int(used[late[0] + 1])
            raise fail(
                "action_steps",
                "commit blocks in order, every step of a block before any step of a later one",
                f"step {step} in block {blocks[step]} after step {step - 1} in block "
                f"{blocks[step - 1]}",
            )
        if (tokens[row][completion[row]] == mask_id).any():
            raise fail("tokens", f"hold no mask id {mask_id} in the completion", "a mask")
        if not np.isfinite(logps[row][completion[row]]).all():
            raise fail("action_logps", "be finite on the completion", "non-finite")
    _validate_decisions(trace)
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise TraceError(f"`trace.tokens` must be in [0, {vocab_size}); got {tokens.max()}")


def _validate_decisions(trace: Trace) -> None:
    """Planner fields: present exactly for the planner rule, ``[B, L, K]`` finite log-probs
    <= 0 exactly where a draw happened, ``forced`` only on committed slots."""
    planner = trace.settings.commit_rule == "planner"
    for name in ("decision_logps", "forced"):
        if (getattr(trace, name) is None) == planner:
            need = "be given" if planner else "be None"
            raise TraceError(
                f"`trace.{name}` must {need} for commit_rule {trace.settings.commit_rule!r}; "
                f"received {type(getattr(trace, name)).__name__}"
            )
    if not planner:
        return
    shape = (*np.shape(trace.tokens), trace.block_size)
    decisions, forced = np.asarray(trace.decision_logps), np.asarray(trace.forced)
    if decisions.shape != shape or forced.shape != shape[:2]:
        raise TraceError(
            f"`trace.decision_logps` must be {shape} and forced {shape[:2]}; received "
            f"{decisions.shape} and {forced.shape}"
        )
    drawn, _ = decision_layout(trace)
    drawn = np.asarray(drawn)
    if not (np.isfinite(decisions).all() and (decisions <= 0).all()):
        raise TraceError("`trace.decision_logps` must be finite and <= 0; received otherwise")
    if (decisions[~drawn] != 0).any():
        row = int(np.argwhere((decisions != 0) & ~drawn)[0][0])
        raise TraceError(f"`trace.decision_logps` must be 0 where no draw happened (row {row})")
    if (forced & ~np.asarray(trace.completion_mask)).any():
        raise TraceError("`trace.forced` must mark completion slots only; received others")


def _block_first_steps(trace: Trace) -> jax.Array:
    """``[B, L]`` int32: the first step of each slot's block (blocks are windows)."""
    size = trace.block_size
    batch, length = trace.tokens.shape
    steps = jnp.where(trace.completion_mask, trace.action_steps, jnp.iinfo(jnp.int32).max)
    return jnp.repeat(steps.reshape(batch, length // size, size).min(-1), size, axis=1)


def decision_steps(trace: Trace) -> jax.Array:
    """``[B, L, K]`` int32: the row's step of each potential draw ``[b, p, j]`` (the j-th
    step of slot p's block); meaningful where :func:`decision_layout` says a draw exists."""
    return _block_first_steps(trace)[..., None] + jnp.arange(trace.block_size, dtype=jnp.int32)


def decision_layout(trace: Trace) -> tuple[jax.Array, jax.Array]:
    """Which planner draws a trace holds, ``[B, L, K]`` bool each: ``drawn[b, p, j]`` (slot
    p was pending at the j-th step of its block, not counting a ``shifted`` anchor step,
    which draws nothing) and ``committed`` (that draw was a commit: the slot's commit step
    and not forced)."""
    size = trace.block_size
    batch, length = trace.tokens.shape
    steps = jnp.asarray(trace.action_steps)
    completion = jnp.asarray(trace.completion_mask)
    windows = length // size
    first = _block_first_steps(trace)
    j = jnp.arange(size, dtype=jnp.int32)
    step = first[..., None] + j  # [B, L, K]
    drawn = completion[..., None] & (step <= steps[..., None])
    if trace.settings.alignment == "shifted":
        anchored = jnp.repeat(completion.reshape(batch, windows, size)[..., 0], size, axis=1)
        drawn = drawn & ~(anchored[..., None] & (j == 0))
    forced = jnp.asarray(trace.forced) if trace.forced is not None else jnp.zeros_like(completion)
    committed = drawn & (step == steps[..., None]) & ~forced[..., None]
    return drawn, committed


def _draw_logps(commit_logits: jax.Array, drawn: jax.Array, committed: jax.Array) -> jax.Array:
    logp = jnp.where(
        committed, jax.nn.log_sigmoid(commit_logits), jax.nn.log_sigmoid(-commit_logits)
    )
    return jnp.where(drawn, logp, 0.0)


def _check_planner(model: Transformer, trace: Trace) -> None:
    if trace.settings.commit_rule != "planner" or trace.forced is None:
        raise ValueError(
            "`trace.settings.commit_rule` must be 'planner' (with forced flags) to replay "
            f"decisions; received {trace.settings.commit_rule!r}"
        )
    if model.planner is None:
        raise ValueError("`model.config.planner_hidden` must be set to replay decisions; None")


def replay_decisions_per_step(model: Transformer, trace: Trace, *, num_steps: int) -> jax.Array:
    """Reference replay of a planner trace's draws: one full forward per step, ``[B, L, K]``
    like ``trace.decision_logps`` (NaN for draws at steps ``num_steps`` does not cover)."""
    _check_planner(model, trace)
    _check_step_count(trace, num_steps, "num_steps")
    graphdef, state = nnx.split(model)
    size, offset = trace.block_size, _source_offset(trace)
    drawn, committed = decision_layout(trace)
    batch, length = trace.tokens.shape
    first = _block_first_steps(trace)

    @jax.checkpoint
    def body(out, step):
        student: Transformer = nnx.merge(graphdef, state)
        hidden = student.hidden_states(_canvas(trace, step), trace.positions, trace.segment_ids)
        logits = student.commit_logits(hidden)
        if offset:  # a decision reads the state its proposal reads: the previous slot
            logits = jnp.concatenate([jnp.zeros_like(logits[:, :1]), logits[:, :-1]], axis=1)
        column = jax.nn.one_hot(step - first, size, dtype=bool)  # [B, L, K]
        here = column & drawn
        return out + _draw_logps(logits[..., None], here, committed & here), None

    out, _ = jax.lax.scan(
        body,
        jnp.zeros((batch, length, size), jnp.float32),
        jnp.arange(num_steps, dtype=jnp.int32),
    )
    uncovered = drawn & (first[..., None] + jnp.arange(size) >= num_steps)
    return jnp.where(uncovered, jnp.nan, out)


def replay_decisions_packed(
    model: Transformer,
    trace: Trace,
    *,
    num_chunks: int,
    dense: bool = False,
    chunks_per_forward: int | None = None,
) -> jax.Array:
    """Packed replay of a planner trace's draws (one forward over the canvas chunks):
    ``[B, L, K]`` like ``trace.decision_logps``."""
    replayed = replay_completion(
        model,
        trace,
        num_chunks=num_chunks,
        dense=dense,
        chunks_per_forward=chunks_per_forward,
        decisions=True,
    )
    return replayed.scatter(replayed.decision_logps, trace.tokens.shape[1])


def num_steps_bucket(trace: Trace, multiple: int = 8) -> int:
    """A static step count >= every row's steps, rounded up so shapes stay few."""
    most = int(np.asarray(trace.action_steps).max()) + 1
    return max(multiple, -(-most // multiple) * multiple)


def _check_step_count(trace: Trace, count: int, field: str) -> None:
    """Raise if ``count`` is below the trace's step count, when the steps are concrete."""
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1:
        raise ValueError(f"`{field}` must be an integer >= 1; received {count!r}")
    if isinstance(trace.action_steps, jax.core.Tracer):
        return  # under jit: uncovered steps come out NaN (module docstring)
    needed = int(np.max(np.asarray(trace.action_steps), initial=-1)) + 1
    if count < needed:
        raise ValueError(
            f"`{field}` must be >= {needed}, the trace's step count (num_steps_bucket gives a "
            f"bucketed count); received {count}"
        )


def _source_offset(trace: Trace) -> int:
    return 1 if trace.settings.alignment == "shifted" else 0


def _log_probs(model: Transformer, hidden, targets, trace: Trace, vocab_chunk) -> jax.Array:
    return gathered_log_probs(
        hidden,
        model.output_embedding(),
        targets,
        temperature=trace.settings.temperature,
        excluded_id=trace.settings.mask_id,
        vocab_chunk=vocab_chunk,
    )


def _canvas(trace: Trace, step: jax.Array) -> jax.Array:
    masked = trace.completion_mask & (trace.action_steps >= step)
    return jnp.where(masked, trace.settings.mask_id, trace.tokens)


def replay_per_step(
    model: Transformer, trace: Trace, *, num_steps: int, vocab_chunk: int | None = 4096
) -> jax.Array:
    """Reference replay: one full forward per step ``0..num_steps-1`` (steps no row took
    contribute nothing). ``num_steps`` is static and must cover every recorded step (use
    :func:`num_steps_bucket`): checked when the trace is concrete, NaN where it is not."""
    _check_step_count(trace, num_steps, "num_steps")
    graphdef, state = nnx.split(model)
    batch, length = trace.tokens.shape
    size, offset = trace.block_size, _source_offset(trace)
    rows = jnp.arange(batch)[:, None]

    @jax.checkpoint
    def body(out, step):
        student: Transformer = nnx.merge(graphdef, state)
        hidden = student.hidden_states(_canvas(trace, step), trace.positions, trace.segment_ids)
        scored = trace.completion_mask & (trace.action_steps == step)
        # At most one block's slots are scored per row and step: gather them first.
        slots = jnp.argsort(~scored, axis=1, stable=True)[:, :size]
        chosen = jnp.take_along_axis(scored, slots, axis=1)
        source = jnp.maximum(slots - offset, 0)
        picked = jnp.take_along_axis(hidden, source[..., None], axis=1)
        targets = jnp.take_along_axis(trace.tokens, slots, axis=1)
        logp = _log_probs(student, picked, targets, trace, vocab_chunk)
        return out.at[rows, slots].add(jnp.where(chosen, logp, 0.0)), None

    out, _ = jax.lax.scan(
        body, jnp.zeros((batch, length), jnp.float32), jnp.arange(num_steps, dtype=jnp.int32)
    )
    # An action the scan never reached would read 0 (probability 1): make it loud.
    uncovered = trace.completion_mask & (trace.action_steps >= num_steps)
    return jnp.where(uncovered, jnp.nan, out)


def _chunks(trace: Trace, num_chunks: int) -> tuple[jax.Array, jax.Array]:
    """Chunk c of a row is step c's canvas of the block that step committed in:
    ``sources`` ``[B, C, K]`` (slot copied, -1 for a step the row never took) and
    ``canvas`` ``[B, C, K]``."""
    size = trace.block_size
    length = trace.tokens.shape[1]
    steps = jnp.arange(num_chunks, dtype=jnp.int32)
    hits = trace.action_steps[:, None, :] == steps[None, :, None]  # [B, C, L]
    window = jnp.max(jnp.where(hits, jnp.arange(length) // size, -1), axis=-1)  # [B, C]
    sources = window[..., None] * size + jnp.arange(size)
    sources = jnp.where(window[..., None] >= 0, sources, -1)
    safe = jnp.maximum(sources, 0)
    gather = jax.vmap(lambda row, idx: row[idx])
    tokens = gather(trace.tokens, safe)
    masked = gather(trace.completion_mask, safe) & (
        gather(trace.action_steps, safe) >= steps[None, :, None]
    )
    return sources, jnp.where(masked, trace.settings.mask_id, tokens)


def _completion_slots(trace: Trace) -> tuple[jax.Array, jax.Array]:
    """Completion slots of each row, in order: ``slots`` ``[B, N]``, ``present`` ``[B, N]``
    with ``N = settings.completion_length`` (the completion is contiguous)."""
    length = trace.tokens.shape[1]
    start = jnp.argmax(trace.completion_mask, axis=1)
    slots = jnp.minimum(start[:, None] + jnp.arange(trace.settings.completion_length), length - 1)
    return slots, jnp.take_along_axis(trace.completion_mask, slots, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompletionReplay:
    """Replay in completion space (``N = settings.completion_length`` slots per row, in
    order): ``slots`` ``[B, N]`` int32 (row slot of each completion position), ``present``
    ``[B, N]`` bool, ``logps`` ``[B, N]`` float32 (each action's log-prob, 0 where not
    present) and, when asked for, ``log_probs`` ``[B, N, V]`` float32: the full sampling
    distribution (rollout temperature, mask id excluded) each action was drawn from, or
    ``gathered_logps`` ``[B, N, k]``: that distribution at k given ids per token (-inf at the
    mask id), without materializing ``[B, N, V]``; for a planner trace, when asked for,
    ``decision_logps`` ``[B, N, K]``: every commit draw's log-prob (``trace.decision_logps``
    in completion space)."""

    slots: jax.Array
    present: jax.Array
    logps: jax.Array
    log_probs: jax.Array | None = None
    gathered_logps: jax.Array | None = None
    decision_logps: jax.Array | None = None

    def scatter(self, values: jax.Array, length: int) -> jax.Array:
        """``[B, N, ...]`` completion values -> ``[B, length, ...]`` row layout (0 elsewhere)."""
        rows = jnp.arange(values.shape[0])[:, None]
        zeros = jnp.zeros((values.shape[0], length, *values.shape[2:]), values.dtype)
        present = self.present.reshape(self.present.shape + (1,) * (values.ndim - 2))
        return zeros.at[rows, self.slots].add(jnp.where(present, values, 0))

    def gather(self, values: jax.Array) -> jax.Array:
        """``[B, L, ...]`` row layout -> ``[B, N, ...]`` completion values."""
        index = self.slots.reshape(self.slots.shape + (1,) * (values.ndim - 2))
        return jnp.take_along_axis(values, index, axis=1)


def replay_packed(
    model: Transformer,
    trace: Trace,
    *,
    num_chunks: int,
    dense: bool = False,
    chunks_per_forward: int | None = None,
    vocab_chunk: int | None = 4096,
) -> jax.Array:
    """Fast exact replay over packed canvas chunks (one per row and step): ``[B, L]``.

    ``num_chunks`` (static) must be >= every row's step count (:func:`num_steps_bucket`):
    checked when the trace is concrete, NaN where it is not. ``chunks_per_forward``
    (block-sparse path only) bounds how many chunks are attended at once; it must divide
    ``num_chunks``.
    """
    replayed = replay_completion(
        model,
        trace,
        num_chunks=num_chunks,
        dense=dense,
        chunks_per_forward=chunks_per_forward,
        vocab_chunk=vocab_chunk,
    )
    return replayed.scatter(replayed.logps, trace.tokens.shape[1])


def replay_completion(
    model: Transformer,
    trace: Trace,
    *,
    num_chunks: int,
    distributions: bool = False,
    gather_ids: jax.Array | None = None,
    dense: bool = False,
    chunks_per_forward: int | None = None,
    vocab_chunk: int | None = 4096,
    decisions: bool = False,
) -> CompletionReplay:
    """:func:`replay_packed` in completion space; ``distributions=True`` also returns the
    full ``[B, N, V]`` sampling distributions (for the full-vocabulary losses: memory grows
    with the vocabulary); ``gather_ids`` ``[B, L, k]`` (row layout, e.g. a teacher's top-k
    ids) returns the distribution at those ids only (chunked log-sum-exp, as for actions);
    ``decisions=True`` (a planner trace) also replays every commit draw from the same
    forward."""
    if decisions:
        _check_planner(model, trace)
    if chunks_per_forward is not None and (
        chunks_per_forward < 1 or num_chunks % chunks_per_forward
    ):
        raise ValueError(
            f"`chunks_per_forward` must divide num_chunks={num_chunks}; "
            f"received {chunks_per_forward}"
        )
    _check_step_count(trace, num_chunks, "num_chunks")
    batch, length = trace.tokens.shape
    size, offset = trace.block_size, _source_offset(trace)
    sources, canvas = _chunks(trace, num_chunks)
    packed = pack_canvas_chunks(trace.tokens, trace.positions, trace.segment_ids, sources, canvas)
    if dense:
        hidden = model.hidden_states(
            packed.tokens, packed.positions, packed.segment_ids, chunk_ids=packed.chunk_ids
        )
    else:
        clean, cache = model.prefill(trace.tokens, trace.positions, trace.segment_ids)
        shape = (batch, num_chunks, size)
        chunk_pos = packed.positions[:, length:].reshape(shape)
        chunk_seg = packed.segment_ids[:, length:].reshape(shape)
        group = chunks_per_forward or num_chunks
        graphdef, state = nnx.split(model)

        def run_group(args):
            tokens, pos, seg = args
            return nnx.merge(graphdef, state).chunk_hidden_states(cache, tokens, pos, seg)

        if group < num_chunks:
            # Bounding memory is the point of groups: recompute each group in the backward
            # pass instead of keeping its activations. One group needs no rematerialization.
            run_group = jax.checkpoint(run_group)

        def grouped(array):  # [B, C, K] -> [C / G, B, G, K]
            return array.reshape(batch, num_chunks // group, group, size).swapaxes(0, 1)

        chunk_hidden = jax.lax.map(
            run_group, (grouped(canvas), grouped(chunk_pos), grouped(chunk_seg))
        )
        chunk_hidden = chunk_hidden.swapaxes(0, 1).reshape(batch, num_chunks * size, -1)
        hidden = jnp.concatenate([clean, chunk_hidden], axis=1)

    slots, present = _completion_slots(trace)
    recorded = jnp.take_along_axis(trace.action_steps, slots, axis=1)
    uncovered = present & (recorded >= num_chunks)
    step = jnp.clip(recorded, 0, num_chunks - 1)
    source = slots - offset
    in_block = source // size == slots // size
    source_index = jnp.where(in_block, length + step * size + source % size, source)
    picked = jnp.take_along_axis(hidden, jnp.maximum(source_index, 0)[..., None], axis=1)
    # A step past the last chunk has no canvas: everything read from it is NaN, never a
    # plausible value from another step's chunk.
    picked = jnp.where(uncovered[..., None], jnp.nan, picked)
    targets = jnp.take_along_axis(trace.tokens, slots, axis=1)
    logp = jnp.where(present, _log_probs(model, picked, targets, trace, vocab_chunk), 0.0)
    gathered = None
    if gather_ids is not None:
        ids = jnp.take_along_axis(gather_ids, slots[..., None], axis=1)
        gathered = gathered_log_probs(
            picked,
            model.output_embedding(),
            ids,
            temperature=trace.settings.temperature,
            excluded_id=trace.settings.mask_id,
            vocab_chunk=vocab_chunk,
        )
        gathered = jnp.where(ids == trace.settings.mask_id, -jnp.inf, gathered)
    log_probs = None
    if distributions:
        log_probs = tempered_log_softmax(
            model.logits(picked), trace.settings.temperature, trace.settings.mask_id
        )
    decision_logps = None
    if decisions:
        # Chunk c holds step c's canvas of its block: the planner's logit of slot k there is
        # the one the rollout's draw read at that step.
        chunk_hidden = hidden[:, length:].reshape(batch, num_chunks, size, -1)
        chunk_logits = model.commit_logits(chunk_hidden)  # [B, C, K]
        if offset:
            chunk_logits = jnp.concatenate(
                [jnp.zeros_like(chunk_logits[..., :1]), chunk_logits[..., :-1]], axis=-1
            )
        drawn, committed = (_gather_slots(a, slots) for a in decision_layout(trace))
        first = jnp.take_along_axis(_block_first_steps(trace), slots, axis=1)
        step = first[..., None] + jnp.arange(size)
        within = (slots % size)[..., None]
        flat = chunk_logits.reshape(batch, num_chunks * size)
        index = jnp.clip(step, 0, num_chunks - 1) * size + within  # [B, N, K]
        picked_logits = jnp.take_along_axis(flat, index.reshape(batch, -1), axis=1).reshape(
            index.shape
        )
        drawn = drawn & present[..., None]
        decision_logps = _draw_logps(picked_logits, drawn, committed & drawn)
        decision_logps = jnp.where(drawn & (step >= num_chunks), jnp.nan, decision_logps)
    return CompletionReplay(
        slots=slots,
        present=present,
        logps=logp,
        log_probs=log_probs,
        gathered_logps=gathered,
        decision_logps=decision_logps,
    )


def _gather_slots(values: jax.Array, slots: jax.Array) -> jax.Array:
    """``[B, L, ...]`` row layout -> ``[B, N, ...]`` at completion ``slots`` ``[B, N]``."""
    index = slots.reshape(slots.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, index, axis=1)
