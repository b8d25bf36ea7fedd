"""Conversions between :class:`~distill.opd.records.RolloutBatch` and the wire's
``TraceRow`` messages (``protos/rollout.proto``), one message per row.

Floats travel as proto ``float`` (float32), ints as ``int32`` / ``int64``, so a batch that
crosses the wire and comes back is bit-identical. :func:`batches_from_rows` refuses a
malformed message with :class:`~distill.diffusion.replay.TraceError` (a ``ValueError``)
naming the field and the message index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from distill.diffusion.denoise import SamplingSettings
from distill.diffusion.replay import TraceError
from distill.opd.records import PLANNER_FIELDS, SLOT_FIELDS, RolloutBatch, slot_fields
from services.proto import rollout_pb2

_SETTINGS_STRINGS = ("alignment", "commit_rule", "confidence", "strategy")
_SETTINGS_NUMBERS = ("threshold", "temperature", "greedy", "stop_when_done")
_SETTINGS_IDS = ("completion_length", "mask_id", "pad_id")


def settings_to_proto(settings: SamplingSettings) -> rollout_pb2.SamplingSettings:
    return rollout_pb2.SamplingSettings(
        **{name: getattr(settings, name) for name in _SETTINGS_STRINGS + _SETTINGS_NUMBERS},
        **{name: getattr(settings, name) for name in _SETTINGS_IDS},
        schedule_steps=settings.schedule_steps or 0,
        stop_ids=list(settings.stop_ids),
    )


def settings_from_proto(message: rollout_pb2.SamplingSettings) -> SamplingSettings:
    return SamplingSettings(
        **{name: getattr(message, name) for name in _SETTINGS_STRINGS + _SETTINGS_NUMBERS},
        **{name: int(getattr(message, name)) for name in _SETTINGS_IDS},
        schedule_steps=message.schedule_steps or None,
        stop_ids=tuple(int(token) for token in message.stop_ids),
    )


def rows_to_proto(
    batch: RolloutBatch,
    *,
    seed: int,
    worker_id: str,
    completions: Sequence[Sequence[int]] = (),
    texts: Sequence[str] = (),
) -> list[rollout_pb2.TraceRow]:
    """One ``TraceRow`` per row of ``batch`` (``completions`` / ``texts``: the visible,
    stop-truncated completion of each row, when known)."""
    settings = settings_to_proto(batch.settings)
    rows = []
    for index in range(batch.rows):
        message = rollout_pb2.TraceRow(
            step=batch.step,
            row_id=int(batch.row_ids[index]),
            stream_position=int(batch.stream_positions[index]),
            policy_version=batch.policy_version,
            seed=seed,
            worker_id=worker_id,
            block_size=batch.block_size,
            settings=settings,
            forwards=int(batch.forwards[index]),
            completion_ids=list(completions[index]) if completions else [],
            completion_text=texts[index] if texts else "",
        )
        for name in slot_fields(batch.settings):
            # decision_logps [L, K] travels flattened row-major.
            getattr(message, name).extend(np.asarray(batch.slots[name][index]).ravel().tolist())
        rows.append(message)
    return rows


def _row_error(index: int, field: str, requirement: str, received: object) -> TraceError:
    return TraceError(f"`rows[{index}].{field}` must {requirement}; received {received!r}")


def _row_batch(index: int, message: rollout_pb2.TraceRow) -> RolloutBatch:
    if not message.HasField("settings"):
        raise _row_error(index, "settings", "be given", None)
    length = len(message.tokens)
    if length == 0:
        raise _row_error(index, "tokens", "hold the row's slots", 0)
    slots = {}
    for name, dtype in SLOT_FIELDS.items():
        values = getattr(message, name)
        if len(values) != length:
            raise _row_error(index, name, f"have {length} entries (one per slot)", len(values))
        slots[name] = np.asarray(values, dtype)[None, :]
    for name in ("step", "policy_version", "row_id", "stream_position", "block_size"):
        if getattr(message, name) < 0 or (name == "block_size" and message.block_size < 1):
            raise _row_error(index, name, "be >= 0 (block_size >= 1)", getattr(message, name))
    try:
        settings = settings_from_proto(message.settings)
    except (TypeError, ValueError) as error:
        raise TraceError(f"`rows[{index}]`: {error}") from None
    planner = settings.commit_rule == "planner"
    for name, dtype in PLANNER_FIELDS.items():
        values = getattr(message, name)
        width = int(message.block_size) if name == "decision_logps" else 1
        wanted = length * width if planner else 0
        if len(values) != wanted:
            raise _row_error(
                index,
                name,
                f"have {wanted} entries for commit_rule {settings.commit_rule!r}",
                len(values),
            )
        if planner:
            shape = (1, length, width) if name == "decision_logps" else (1, length)
            slots[name] = np.asarray(values, dtype).reshape(shape)
    try:
        return RolloutBatch(
            step=int(message.step),
            policy_version=int(message.policy_version),
            row_ids=np.asarray([message.row_id], np.int64),
            stream_positions=np.asarray([message.stream_position], np.int64),
            slots=slots,
            forwards=np.asarray([message.forwards], np.int32),
            settings=settings,
            block_size=int(message.block_size),
        )
    except (TypeError, ValueError) as error:
        raise TraceError(f"`rows[{index}]`: {error}") from None


def batches_from_rows(messages: Iterable[rollout_pb2.TraceRow]) -> list[RolloutBatch]:
    """Rows grouped into one batch per (step, policy version, physical length, settings,
    block size), rows in arrival order, so a row made under other settings is checked (and
    refused) by the field that differs. Raises :class:`TraceError` naming the first
    malformed row's field."""
    groups: dict[tuple, list[RolloutBatch]] = {}
    for index, message in enumerate(messages):
        row = _row_batch(index, message)
        key = (
            row.step,
            row.policy_version,
            row.slots["tokens"].shape[1],
            row.settings,
            row.block_size,
        )
        groups.setdefault(key, []).append(row)
    return [concat_rows(rows) for rows in groups.values()]


def concat_rows(rows: Sequence[RolloutBatch]) -> RolloutBatch:
    """Rows of one step, version and physical length stacked into one batch."""
    first = rows[0]
    for row in rows[1:]:
        if row.settings != first.settings or row.block_size != first.block_size:
            raise TraceError(
                "`rows.settings` must be the same for every row of one step; received "
                f"{row.settings!r} and {first.settings!r}"
            )
    return dataclasses.replace(
        first,
        row_ids=np.concatenate([row.row_ids for row in rows]),
        stream_positions=np.concatenate([row.stream_positions for row in rows]),
        slots={name: np.concatenate([row.slots[name] for row in rows]) for name in first.slots},
        forwards=np.concatenate([row.forwards for row in rows]),
    )
