"""Batch preparation: a rollout trace -> what the learner trains on.

:func:`prepare_batch` turns a :class:`~distill.diffusion.denoise.Trace` into a
:class:`PreparedBatch`: OPD weights (completion through the first stop token; invalid rows
zeroed and counted), the teacher's log-prob of every generated token and, for the
distribution losses, its top-k ids / log-probs (the whole vocabulary for the full kinds),
scored on the prompt + completion through the first stop only (nothing after the stop is
seen); task rewards and group ids for GRPO. The teacher signal is always computed here, at
learner time, never by the rollout. A teacher with another tokenizer scores each row's
text instead, mapped back onto the student's tokens by byte offsets
(:mod:`distill.cross_tokenizer`; rows that cannot be detokenized exactly are refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distill.cross_tokenizer import TextTeacher, score_completions
from distill.data.tasks import Example, verify
from distill.diffusion.denoise import Trace
from distill.evaluate import completion_text
from distill.losses import OpdLoss, opd_weights
from distill.teacher import Teacher, TeacherInfo
from distill.tokenizer import Tokenizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """What the learner trains on: the trace plus ``weights`` ``[B, L]`` float32,
    ``teacher_logps`` ``[B, L]`` float32 (0 where the weight is 0), ``invalid_rows`` ``[B]``
    bool (rows whose weights were zeroed because they broke an invariant) and the
    ``policy_version`` (int32 scalar: data, not a static, so it never triggers a compile).

    Optional: ``teacher_topk_ids`` int32 / ``teacher_topk_logps`` float32 ``[B, L, k]`` (the
    teacher's top-k at each weighted token, 0 elsewhere; k = the teacher's vocabulary for
    the full-vocabulary kinds); ``rewards`` float32 / ``group_ids`` int32 ``[B]`` (task
    reward of each row and its prompt group, for GRPO); ``refused_rows`` ``[B]`` bool (a
    cross-tokenizer batch: rows refused because their completion could not be detokenized
    and scored exactly; also flagged in ``invalid_rows``)."""

    trace: Trace
    weights: jax.Array
    teacher_logps: jax.Array
    invalid_rows: jax.Array
    policy_version: jax.Array
    teacher_topk_ids: jax.Array | None = None
    teacher_topk_logps: jax.Array | None = None
    rewards: jax.Array | None = None
    group_ids: jax.Array | None = None
    refused_rows: jax.Array | None = None


def teacher_sequences(trace: Trace, visible: np.ndarray) -> list[list[int]]:
    """Each row's teacher-visible tokens in logical order (prompt + completion through the
    first stop). Positions are 0..n-1 over a row's valid slots, so slot order is logical."""
    tokens, positions = np.asarray(trace.tokens), np.asarray(trace.positions)
    out = []
    for row in range(tokens.shape[0]):
        slots = np.flatnonzero(visible[row])
        out.append(tokens[row, slots[np.argsort(positions[row, slots])]].tolist())
    return out


def row_ids(trace: Trace, visible: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's teacher-visible prompt ids and completion ids (through the first stop), in
    logical order."""
    tokens, positions = np.asarray(trace.tokens), np.asarray(trace.positions)
    completion = np.asarray(trace.completion_mask, bool)
    prompts, completions = [], []
    for row in range(tokens.shape[0]):
        slots = np.flatnonzero(visible[row])
        slots = slots[np.argsort(positions[row, slots])]
        prompts.append(tokens[row, slots[~completion[row, slots]]].tolist())
        completions.append(tokens[row, slots[completion[row, slots]]].tolist())
    return prompts, completions


def _cross_tokenizer_logps(
    trace: Trace, weights: np.ndarray, visible: np.ndarray, teacher: TextTeacher, tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """``teacher_logps`` ``[B, L]`` from a text-scoring teacher, mapped onto the weighted
    completion slots (which are the visible completion slots, in logical order), and the
    ``[B]`` rows refused (:func:`~distill.cross_tokenizer.score_completions`)."""
    batch = weights.shape[0]
    teacher_logps = np.zeros(weights.shape, np.float32)
    refused = np.zeros(batch, bool)
    rows = [row for row in range(batch) if weights[row].sum() > 0]
    if not rows:
        return teacher_logps, refused
    prompts, completions = row_ids(trace, visible)
    mapped = score_completions(
        teacher, tokenizer, [prompts[row] for row in rows], [completions[row] for row in rows]
    )
    positions = np.asarray(trace.positions)
    completion = np.asarray(trace.completion_mask, bool)
    for row, result in zip(rows, mapped, strict=True):
        if result.log_probs is None:
            refused[row] = True
            continue
        slots = np.flatnonzero(visible[row] & completion[row])
        slots = slots[np.argsort(positions[row, slots])]
        teacher_logps[row, slots] = result.log_probs
    return teacher_logps, refused


def teacher_top_k(loss: OpdLoss, info: TeacherInfo) -> int | None:
    """How many of the teacher's entries per token the loss needs: none for ``reverse_kl``
    (the sampled token's log-prob alone), ``loss.teacher_top_k``, or the whole teacher
    vocabulary for the full-vocabulary kinds."""
    if loss.kind == "reverse_kl":
        return None
    if loss.teacher_top_k is None:
        return info.vocab_size
    if loss.teacher_top_k > info.vocab_size:
        raise ValueError(
            f"`loss.teacher_top_k` must be <= the teacher's vocabulary {info.vocab_size}; "
            f"received {loss.teacher_top_k}"
        )
    return loss.teacher_top_k


def _optional_rows(name: str, values: Sequence[float] | None, rows: int, dtype) -> jax.Array | None:
    if values is None:
        return None
    array = np.asarray(values, dtype)
    if array.shape != (rows,):
        raise ValueError(f"`{name}` must have shape [{rows}] (one per row); received {array.shape}")
    return jnp.asarray(array)


def prepare_batch(
    trace: Trace,
    teacher: Teacher,
    tokenizer: Tokenizer,
    *,
    policy_version: int = 0,
    top_k: int | None = None,
    rewards: Sequence[float] | None = None,
    group_ids: Sequence[int] | None = None,
    cross_tokenizer: bool = False,
) -> PreparedBatch:
    """Weights and teacher scores for a trace (``top_k``: also the teacher's top-k entries
    per token); a non-finite teacher log-prob on a weighted token is an error.

    ``cross_tokenizer``: the teacher has another tokenizer and scores text (a
    :class:`~distill.cross_tokenizer.TextTeacher`): each row's prompt and completion are
    detokenized with ``tokenizer``, scored as text and mapped back onto the completion
    tokens by byte offsets; a row that cannot be detokenized (or scored) exactly gets weight
    0 and is flagged in ``invalid_rows`` and ``refused_rows``. No top-k then."""
    weights, visible, invalid = opd_weights(
        trace.tokens,
        trace.completion_mask,
        trace.positions,
        trace.segment_ids,
        stop_ids=tokenizer.special.stop_ids,
    )
    weights, visible = np.array(weights), np.asarray(visible)
    batch, length = weights.shape
    if cross_tokenizer:
        if top_k is not None:
            raise ValueError(
                "`top_k` must be None when the teacher's tokenizer differs from the student's; "
                f"received {top_k}"
            )
        teacher_logps, refused = _cross_tokenizer_logps(trace, weights, visible, teacher, tokenizer)
        weights[refused] = 0.0
        invalid = np.asarray(invalid) | refused
        _check_finite(weights, teacher_logps)
        return PreparedBatch(
            trace=trace,
            weights=jnp.asarray(weights, jnp.float32),
            teacher_logps=jnp.asarray(np.where(weights > 0, teacher_logps, 0.0), jnp.float32),
            invalid_rows=jnp.asarray(invalid),
            policy_version=jnp.int32(policy_version),
            rewards=_optional_rows("rewards", rewards, batch, np.float32),
            group_ids=_optional_rows("group_ids", group_ids, batch, np.int32),
            refused_rows=jnp.asarray(refused),
        )
    positions = np.asarray(trace.positions)
    teacher_logps = np.zeros(weights.shape, np.float32)
    topk_ids = np.zeros((batch, length, top_k or 0), np.int32)
    topk_logps = np.zeros((batch, length, top_k or 0), np.float32)
    rows = [row for row in range(batch) if visible[row].sum() >= 2]
    sequences = teacher_sequences(trace, visible)
    scored = teacher.score([sequences[row] for row in rows], top_k=top_k) if rows else []
    for row, result in zip(rows, scored, strict=True):
        slots = np.flatnonzero(visible[row])
        slots = slots[positions[row, slots] >= 1]
        # Entry i of the result scores logical position i + 1.
        entries = positions[row, slots] - 1
        teacher_logps[row, slots] = result.log_probs[entries]
        if top_k is not None:
            topk_ids[row, slots] = result.top_ids[entries]
            topk_logps[row, slots] = result.top_log_probs[entries]
    _check_finite(weights, teacher_logps)
    # Top-k log-probs may be -inf (zero mass) but never NaN or +inf on a weighted token.
    bad_topk = (weights > 0) & (np.isnan(topk_logps) | (topk_logps == np.inf)).any(axis=-1)
    if bad_topk.any():
        row = int(np.argwhere(bad_topk)[0][0])
        raise ValueError(
            f"`teacher_topk_logps` must be finite or -inf on weighted tokens; row {row} holds "
            "NaN or +inf"
        )
    weighted = (weights > 0)[..., None]
    return PreparedBatch(
        trace=trace,
        weights=jnp.asarray(weights, jnp.float32),
        teacher_logps=jnp.asarray(np.where(weights > 0, teacher_logps, 0.0), jnp.float32),
        invalid_rows=jnp.asarray(invalid),
        policy_version=jnp.int32(policy_version),
        teacher_topk_ids=None if top_k is None else jnp.asarray(np.where(weighted, topk_ids, 0)),
        teacher_topk_logps=None
        if top_k is None
        else jnp.asarray(np.where(weighted, topk_logps, 0.0), jnp.float32),
        rewards=_optional_rows("rewards", rewards, batch, np.float32),
        group_ids=_optional_rows("group_ids", group_ids, batch, np.int32),
    )


def _check_finite(weights: np.ndarray, teacher_logps: np.ndarray) -> None:
    bad = (weights > 0) & ~np.isfinite(teacher_logps)
    if bad.any():
        row = int(np.argwhere(bad)[0][0])
        raise ValueError(f"`teacher_logps` must be finite on weighted tokens; row {row} is not")


def task_rewards(examples: Sequence[Example], trace: Trace, tokenizer: Tokenizer) -> list[float]:
    """1.0 for each row whose stop-cut completion verifies against its example, else 0.0."""
    completions = trace.completions()
    if len(completions) != len(examples):
        raise ValueError(
            f"`examples` must hold one example per trace row ({len(completions)}); "
            f"received {len(examples)}"
        )
    return [
        float(verify(example, completion_text(tokenizer, ids)))
        for example, ids in zip(examples, completions, strict=True)
    ]
