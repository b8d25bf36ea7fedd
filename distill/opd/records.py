"""A rollout as data that crosses processes: numpy arrays, its identity and policy version.

A rollout worker turns its :class:`~distill.diffusion.denoise.Trace` into a
:class:`RolloutBatch` (:meth:`RolloutBatch.from_trace`), which converts to and from plain
numpy (and from there to the wire). The learner checks it against its own student
(:meth:`RolloutBatch.check_matches`: block size, vocabulary, special ids and sampling
settings), validates it with the library's trace validation, merges the parts of one step
from several workers into the batch the in-process loop would have built
(:func:`merge_batches`) and replays it with :meth:`RolloutBatch.to_trace`.

Identity: ``step`` (the OPD step whose data it is), ``row_ids`` (row index inside that step:
prompt ``row // group_size`` of the step, rollout ``row % group_size``; also the row's RNG
stream), ``stream_positions`` (data stream position of each row's prompt) and
``policy_version`` (the version of the parameters that generated it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from distill.diffusion.denoise import SamplingSettings, Trace
from distill.diffusion.replay import TraceError, validate_trace

#: Per-slot arrays of a trace, with their numpy dtypes (``[B, L]`` each).
SLOT_FIELDS: dict[str, type] = {
    "tokens": np.int32,
    "positions": np.int32,
    "segment_ids": np.int32,
    "prompt_mask": np.bool_,
    "completion_mask": np.bool_,
    "action_steps": np.int32,
    "action_logps": np.float32,
}

#: A planner rollout's commit draws (``commit_rule: planner``): ``decision_logps``
#: ``[B, L, block_size]`` and ``forced`` ``[B, L]``, carried in ``slots`` beside the rest.
PLANNER_FIELDS: dict[str, type] = {"decision_logps": np.float32, "forced": np.bool_}


def slot_fields(settings: SamplingSettings) -> dict[str, type]:
    """The per-slot arrays a trace made under ``settings`` carries, with their dtypes."""
    if settings.commit_rule == "planner":
        return SLOT_FIELDS | PLANNER_FIELDS
    return dict(SLOT_FIELDS)


def _error(field: str, requirement: str, received: object) -> TraceError:
    return TraceError(f"`{field}` must {requirement}; received {received!r}")


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Rows of one step's rollout. ``slots`` maps each of :data:`SLOT_FIELDS` to a
    ``[B, L]`` array (and, for a planner rollout, :data:`PLANNER_FIELDS`: ``[B, L, K]`` /
    ``[B, L]``); ``forwards``, ``row_ids``, ``stream_positions`` are ``[B]``."""

    step: int
    policy_version: int
    row_ids: np.ndarray
    stream_positions: np.ndarray
    slots: dict[str, np.ndarray]
    forwards: np.ndarray
    settings: SamplingSettings
    block_size: int

    def __post_init__(self) -> None:
        for field in ("step", "policy_version", "block_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise _error(f"trace.{field}", "be an int >= 0", value)
        if self.block_size < 1:
            raise _error("trace.block_size", "be >= 1", self.block_size)
        fields = slot_fields(self.settings)
        if set(self.slots) != set(fields):
            raise _error(
                "trace.slots",
                f"hold exactly {sorted(fields)} for commit_rule {self.settings.commit_rule!r}",
                sorted(self.slots),
            )
        shape = np.shape(self.slots["tokens"])
        if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
            raise _error("trace.tokens", "be a non-empty [B, L] array", shape)
        for name, array in self.slots.items():
            want = (*shape, self.block_size) if name == "decision_logps" else shape
            if np.shape(array) != want:
                raise _error(f"trace.{name}", f"have shape {want}", np.shape(array))
        for name in ("forwards", "row_ids", "stream_positions"):
            if np.shape(getattr(self, name)) != shape[:1]:
                raise _error(
                    f"trace.{name}", f"have shape {shape[:1]}", np.shape(getattr(self, name))
                )
        if len(set(np.asarray(self.row_ids).tolist())) != shape[0]:
            raise _error("trace.row_ids", "be distinct", np.asarray(self.row_ids).tolist())
        if (np.asarray(self.row_ids) < 0).any() or (np.asarray(self.stream_positions) < 0).any():
            raise _error("trace.row_ids", "and stream_positions be >= 0", "a negative id")
        if shape[1] % self.block_size:
            raise _error("trace.tokens", f"span whole blocks of {self.block_size}", shape[1])

    @property
    def rows(self) -> int:
        return int(np.shape(self.slots["tokens"])[0])

    @classmethod
    def from_trace(
        cls,
        trace: Trace,
        *,
        step: int,
        policy_version: int,
        row_ids: Sequence[int],
        stream_positions: Sequence[int],
    ) -> RolloutBatch:
        return cls(
            step=step,
            policy_version=policy_version,
            row_ids=np.asarray(row_ids, np.int64),
            stream_positions=np.asarray(stream_positions, np.int64),
            slots={
                name: np.asarray(getattr(trace, name)).astype(dtype, copy=False)
                for name, dtype in slot_fields(trace.settings).items()
            },
            forwards=np.asarray(trace.forwards, np.int32),
            settings=trace.settings,
            block_size=trace.block_size,
        )

    def to_trace(self) -> Trace:
        """The trace (device arrays) to replay; dtypes exactly as the rollout made them."""
        return Trace(
            **{
                name: jnp.asarray(np.asarray(self.slots[name], dtype))
                for name, dtype in slot_fields(self.settings).items()
            },
            forwards=jnp.asarray(np.asarray(self.forwards, np.int32)),
            settings=self.settings,
            block_size=self.block_size,
        )

    def check_matches(self, settings: SamplingSettings, block_size: int, vocab_size: int) -> None:
        """Refuse a batch made under other settings than the learner's student (block size,
        sampling settings incl. mask / pad / stop ids), or one that breaks the replay contract
        (:func:`~distill.diffusion.replay.validate_trace`, ids inside ``vocab_size``)."""
        if self.block_size != block_size:
            raise _error("trace.block_size", f"equal the learner's {block_size}", self.block_size)
        for field in dataclasses.fields(SamplingSettings):
            got, want = getattr(self.settings, field.name), getattr(settings, field.name)
            if got != want:
                raise _error(f"trace.settings.{field.name}", f"equal the learner's {want!r}", got)
        # A host-side view (numpy arrays): validation reads numpy, no device round trip.
        host = Trace(
            **self.slots,
            forwards=self.forwards,
            settings=self.settings,
            block_size=self.block_size,
        )
        validate_trace(host, vocab_size)

    def row(self, index: int) -> RolloutBatch:
        """Row ``index`` alone (a ``[1, L]`` batch)."""
        pick = slice(index, index + 1)
        return dataclasses.replace(
            self,
            row_ids=self.row_ids[pick],
            stream_positions=self.stream_positions[pick],
            slots={name: array[pick] for name, array in self.slots.items()},
            forwards=self.forwards[pick],
        )


def _first_window(batch: RolloutBatch) -> int:
    """The window holding the first completion slot (the same in every row of a batch)."""
    completion = np.asarray(batch.slots["completion_mask"])
    steps = np.asarray(batch.slots["action_steps"])
    firsts = {
        int(np.argmax(completion[row] | (steps[row] >= 0))) // batch.block_size
        for row in range(batch.rows)
        if completion[row].any()
    }
    if len(firsts) != 1:
        raise _error("trace.completion_mask", "start in the same window in every row", firsts)
    return firsts.pop()


def merge_batches(parts: Sequence[RolloutBatch]) -> RolloutBatch:
    """One step's parts (from one or several workers) as the single batch the in-process
    loop builds: rows ordered by ``row_ids``, each left-padded by whole blocks so every
    row's completion starts in the same window (the layout of the whole batch's prompts).
    All parts must share step, policy version, settings and block size."""
    if not parts:
        raise _error("parts", "hold at least one rollout batch", 0)
    first = parts[0]
    for part in parts[1:]:
        for field in ("step", "policy_version", "settings", "block_size"):
            if getattr(part, field) != getattr(first, field):
                raise _error(
                    f"trace.{field}",
                    f"be the same in every part ({getattr(first, field)!r})",
                    getattr(part, field),
                )
    if len(parts) == 1:
        merged = first
    else:
        windows = [_first_window(part) for part in parts]
        common = max(windows)
        padding = {
            "tokens": first.settings.pad_id,
            "positions": 0,
            "segment_ids": 0,
            "prompt_mask": False,
            "completion_mask": False,
            "action_steps": -1,
            "action_logps": 0.0,
            "decision_logps": 0.0,
            "forced": False,
        }
        slots = {}
        for name, dtype in slot_fields(first.settings).items():
            shifted = []
            for part, window in zip(parts, windows, strict=True):
                width = (common - window) * first.block_size
                trailing = np.shape(part.slots[name])[2:]
                pad = np.full((part.rows, width, *trailing), padding[name], dtype)
                shifted.append(np.concatenate([pad, np.asarray(part.slots[name], dtype)], axis=1))
            lengths = {array.shape[1] for array in shifted}
            if len(lengths) != 1:
                raise _error("trace.tokens", "have one completion horizon in every part", lengths)
            slots[name] = np.concatenate(shifted, axis=0)
        merged = dataclasses.replace(
            first,
            row_ids=np.concatenate([part.row_ids for part in parts]),
            stream_positions=np.concatenate([part.stream_positions for part in parts]),
            slots=slots,
            forwards=np.concatenate([part.forwards for part in parts]),
        )
    order = np.argsort(merged.row_ids, kind="stable")
    if np.array_equal(order, np.arange(merged.rows)):
        return merged
    return dataclasses.replace(
        merged,
        row_ids=merged.row_ids[order],
        stream_positions=merged.stream_positions[order],
        slots={name: array[order] for name, array in merged.slots.items()},
        forwards=merged.forwards[order],
    )


def save_batch(batch: RolloutBatch, path: str | Path) -> None:
    """Write ``batch`` as one ``.npz`` (arrays, identity, settings) for inspection and
    comparison; :func:`load_batch` reads it back bit-identical."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = json.dumps(dataclasses.asdict(batch.settings))
    temporary = path.with_suffix(".tmp.npz")
    np.savez(
        temporary,
        **batch.slots,
        forwards=batch.forwards,
        row_ids=batch.row_ids,
        stream_positions=batch.stream_positions,
        identity=np.asarray([batch.step, batch.policy_version, batch.block_size], np.int64),
        settings=np.asarray(settings),
    )
    temporary.replace(path)


def load_batch(path: str | Path) -> RolloutBatch:
    with np.load(path) as data:
        step, version, block_size = (int(value) for value in data["identity"])
        settings = json.loads(str(data["settings"]))
        settings["stop_ids"] = tuple(settings["stop_ids"])
        return RolloutBatch(
            step=step,
            policy_version=version,
            row_ids=data["row_ids"],
            stream_positions=data["stream_positions"],
            slots={name: data[name] for name in slot_fields(SamplingSettings(**settings))},
            forwards=data["forwards"],
            settings=SamplingSettings(**settings),
            block_size=block_size,
        )
