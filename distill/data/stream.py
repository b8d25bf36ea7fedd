"""Deterministic, resumable streams of task examples.

A stream is a spec plus a seed. Position ``k`` of a stream is computed from a generator seeded by
``(seed, split_id, k)`` alone (``np.random.default_rng([seed, split_id, k])``), never from global
state nor from the positions before it, so any position can be regenerated after a restart and
positions can be read in any order. For each position the generator draws, in this order: the
task (uniform over ``tasks``, in the order given), the length (uniform in
``[min_length, max_length]``), then the task's own sample.

Splits (``"train"``, ``"eval"``, ``"validation"``) enter the seed through :data:`SPLITS`, so each
split is a different sequence for the same seed: ``validation`` is held out from both training
and the reported eval, for choices made from measurements (which checkpoint to keep) that must
not be scored on the numbers they were chosen by. (Tasks with tiny instance spaces, such as
``agree`` whose prompt is fixed by its length, can still produce equal prompts in several.)

With ``limit`` set the stream has that many positions; asking for position ``>= limit`` raises
:class:`~distill.data.tasks.DataError` naming `position`: an exhausted stream is an error, never a
silent wrap-around.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from distill.config import DataConfig
from distill.data.tasks import TASKS, DataError, Example, Task, _error, check_position
from distill.tokenizer import Tokenizer

__all__ = [
    "SPLITS",
    "STREAM_FORMAT",
    "TaskStream",
    "encode_example",
]

#: Recorded in :meth:`TaskStream.stream_spec`; bump when any task's format or the draw order
#: changes, so a run contract written by an older version is refused instead of silently differing.
STREAM_FORMAT: str = "distill.data.TaskStream/v1"

#: Split name -> the id mixed into every position's seed.
SPLITS: Mapping[str, int] = {"train": 0, "eval": 1, "validation": 2}

_UNSET: Any = object()


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class TaskStream:
    """A deterministic stream of :class:`~distill.data.tasks.Example` over a task mixture.

    Built from a :class:`~distill.config.DataConfig` (``TaskStream(config)``) and/or explicit
    ``tasks``, ``seed``, ``min_length``, ``max_length``, ``batch_size`` keywords, which override
    the config's values (with no config the :class:`DataConfig` defaults apply). Every length in
    the range must be valid for every task (e.g. ``sudoku`` allows at most 16 blanks); invalid
    arguments raise :class:`~distill.data.tasks.DataError` naming the field.
    """

    def __init__(
        self,
        config: DataConfig | None = None,
        *,
        tasks: Sequence[str] | None = None,
        seed: int | None = None,
        min_length: int | None = None,
        max_length: int | None = None,
        batch_size: int | None = None,
        split: str = "train",
        limit: int | None = None,
    ) -> None:
        if config is None:
            config = DataConfig()
        elif not isinstance(config, DataConfig):
            raise _error("config", "be a DataConfig or None", config)
        tasks = config.tasks if tasks is None else tasks
        seed = config.seed if seed is None else seed
        min_length = config.min_length if min_length is None else min_length
        max_length = config.max_length if max_length is None else max_length
        batch_size = config.batch_size if batch_size is None else batch_size

        if isinstance(tasks, str) or not isinstance(tasks, Sequence):
            raise _error("tasks", "be a sequence of task names", tasks)
        names = tuple(tasks)
        if not names:
            raise _error("tasks", "name at least one task", list(names))
        for name in names:
            if name not in TASKS:
                raise _error("tasks", f"name only known tasks ({', '.join(TASKS)})", name)
        if len(set(names)) != len(names):
            raise _error("tasks", "not repeat a task", list(names))
        for field, value in (
            ("seed", seed),
            ("min_length", min_length),
            ("max_length", max_length),
            ("batch_size", batch_size),
        ):
            if not _is_int(value):
                raise _error(field, "be an int", value)
        if seed < 0:
            raise _error("seed", "be >= 0", seed)
        if batch_size < 1:
            raise _error("batch_size", "be >= 1", batch_size)
        if min_length > max_length:
            raise _error("min_length", f"be <= max_length={max_length}", min_length)
        for name in names:
            task = TASKS[name]
            if min_length < task.min_length:
                raise _error("min_length", f"be >= {task.min_length} for task {name!r}", min_length)
            if task.max_length is not None and max_length > task.max_length:
                raise _error("max_length", f"be <= {task.max_length} for task {name!r}", max_length)
        if split not in SPLITS:
            raise _error("split", f"be one of {', '.join(SPLITS)}", split)
        if limit is not None and (not _is_int(limit) or limit < 0):
            raise _error("limit", "be None or an int >= 0", limit)

        self._names = names
        self._tasks: tuple[Task, ...] = tuple(TASKS[name] for name in names)
        self._seed = int(seed)
        self._min_length = int(min_length)
        self._max_length = int(max_length)
        self._batch_size = int(batch_size)
        self._split = split
        self._split_id = SPLITS[split]
        self._limit = None if limit is None else int(limit)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> TaskStream:
        """Rebuild the stream a :meth:`stream_spec` describes; refuses another format."""
        if not isinstance(spec, Mapping):
            raise _error("spec", "be a mapping", spec)
        if spec.get("format") != STREAM_FORMAT:
            raise _error("spec.format", f"be {STREAM_FORMAT!r}", spec.get("format"))
        expected = {
            "format",
            "tasks",
            "seed",
            "split",
            "min_length",
            "max_length",
            "batch_size",
            "limit",
        }
        if set(spec) != expected:
            raise _error("spec", f"have exactly the keys {sorted(expected)}", sorted(spec))
        return cls(
            tasks=tuple(spec["tasks"]),
            seed=spec["seed"],
            min_length=spec["min_length"],
            max_length=spec["max_length"],
            batch_size=spec["batch_size"],
            split=spec["split"],
            limit=spec["limit"],
        )

    @property
    def tasks(self) -> tuple[str, ...]:
        return self._names

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def split(self) -> str:
        return self._split

    @property
    def min_length(self) -> int:
        return self._min_length

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def limit(self) -> int | None:
        return self._limit

    def stream_spec(self) -> dict[str, Any]:
        """JSON-ready description for the run contract; :meth:`from_spec` inverts it."""
        return {
            "format": STREAM_FORMAT,
            "tasks": list(self._names),
            "seed": self._seed,
            "split": self._split,
            "min_length": self._min_length,
            "max_length": self._max_length,
            "batch_size": self._batch_size,
            "limit": self._limit,
        }

    def _check_position(self, position: object) -> int:
        return check_position(position, self._limit)

    def example(self, position: int) -> Example:
        """The example at ``position``: always the same, whatever was read before."""
        position = self._check_position(position)
        rng = np.random.default_rng([self._seed, self._split_id, position])
        task = self._tasks[int(rng.integers(0, len(self._tasks)))]
        length = int(rng.integers(self._min_length, self._max_length + 1))
        prompt, answer = task.sample(rng, length)
        return Example(task=task.name, prompt=prompt, answer=answer, index=position)

    def batch(self, start: int, size: int | None = None) -> list[Example]:
        """Examples at positions ``start .. start + size - 1`` (``size`` defaults to
        ``batch_size``); raises naming `position` if any lies past ``limit``."""
        size = self._batch_size if size is None else size
        if not _is_int(size) or size < 0:
            raise _error("size", "be an int >= 0", size)
        if size == 0:
            return []
        start = self._check_position(start)
        self._check_position(start + size - 1)
        return [self.example(start + offset) for offset in range(size)]

    def step_batch(self, step: int) -> list[Example]:
        """The ``batch_size`` examples of training step ``step`` (positions from
        ``step * batch_size``)."""
        if not _is_int(step) or step < 0:
            raise _error("step", "be an int >= 0", step)
        return self.batch(int(step) * self._batch_size)

    def iter_from(self, start: int = 0) -> Iterator[Example]:
        """Examples from ``start`` on, ending at ``limit`` (endless without one)."""
        if not _is_int(start) or start < 0:
            raise _error("start", "be an int >= 0", start)
        position = int(start)
        while self._limit is None or position < self._limit:
            yield self.example(position)
            position += 1

    def __iter__(self) -> Iterator[Example]:
        return self.iter_from(0)

    def __len__(self) -> int:
        if self._limit is None:
            raise DataError("`limit` must be set to take len() of a stream; received None")
        return self._limit

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.stream_spec().items())
        return f"TaskStream({args})"


def encode_example(example: Example, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """``([bos] + encode(prompt), encode(answer) + [first stop id])``."""
    if not isinstance(example, Example):
        raise _error("example", "be an Example", example)
    special = tokenizer.special
    prompt_ids = [special.bos_id, *tokenizer.encode(example.prompt)]
    answer_ids = [*tokenizer.encode(example.answer), special.stop_ids[0]]
    return prompt_ids, answer_ids
