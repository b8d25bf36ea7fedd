"""Verifiable synthetic tasks with exact verifiers.

Every task turns ``(rng, length)`` into a ``(prompt, answer)`` pair and judges a completion
exactly. Prompts read ``"<prefix>:<body>|"``: they always end with the separator ``'|'`` so the
completion starts right after it, and they use only characters of
:data:`distill.tokenizer.DEFAULT_ALPHABET`, as do all answers.

============  ======================  ======================  ==================================
task          prompt                  reference answer        ``length`` is
============  ======================  ======================  ==================================
copy          ``copy:qbz|``           ``qbz``                 the number of letters
reverse       ``reverse:qbz|``        ``zbq``                 the number of letters
sort          ``sort:qbz|``           ``bqz``                 the number of letters
addition      ``add:123+45|``         ``168``                 the digits of the longer operand
addition_lsb  ``addlsb:123+45|``      ``861`` (lowest first)  the digits of the longer operand
agree         ``agree:4|``            ``dddd`` (any symbol)   the positions that agree
sudoku        ``sudoku:1?34,...|``    ``1234,3412,...``       the blank cells (1..16)
============  ======================  ======================  ==================================

``verify(prompt, completion)`` judges the completion text (already cut before the stop token)
on its own merits: a task with many correct answers (``agree``, an under-determined ``sudoku``)
accepts any of them, and nothing is stripped or normalised before the comparison. A prompt that
is not one of the task's own raises :class:`DataError` naming `prompt`: that is a caller bug, not a
wrong completion.

Only ``sudoku`` caps ``length``: the long specs of ``deploy/configs/long-tasks.yaml`` (copy,
reverse, sort, addition and addition_lsb at 16-32, answers of 16-33 characters) and
``agree16.yaml`` (16 letters) are the same tasks at larger lengths. :func:`max_sequence_length`
bounds a stream's encoded rows; a job config refuses models that cannot hold them.

``agree`` is the research note's probe: the ``k`` positions must hold the same symbol, but which
of the :data:`AGREE_SYMBOLS` is free, so sampling the positions independently in parallel fails.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "AGREE_SYMBOLS",
    "SEPARATOR",
    "TASKS",
    "AdditionLsbTask",
    "AdditionTask",
    "AgreeTask",
    "CopyTask",
    "DataError",
    "Example",
    "ReverseTask",
    "SortTask",
    "SudokuTask",
    "Task",
    "get_task",
    "max_sequence_length",
    "task_for_prompt",
    "verify",
]

#: Ends every prompt; the completion starts right after it.
SEPARATOR: str = "|"

#: The symbols an ``agree`` answer may repeat (any one of them, chosen freely).
AGREE_SYMBOLS: str = "abcdefgh"

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_SUDOKU_SIZE = 4
_SUDOKU_CELLS = _SUDOKU_SIZE * _SUDOKU_SIZE
_SUDOKU_DIGITS = "1234"
_SUDOKU_BLANK = "?"
_SUDOKU_ROW_SEP = ","


class DataError(ValueError):
    """Invalid data configuration or input. Messages read "`field` must ...; received ..."."""


def _error(field: str, must: str, received: object) -> DataError:
    return DataError(f"`{field}` must {must}; received {received!r}")


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: ``answer`` is one canonical reference answer (others may verify too);
    ``index`` is the stream position it was generated for."""

    task: str
    prompt: str
    answer: str
    index: int


@runtime_checkable
class Task(Protocol):
    """A verifiable task. ``length`` must lie in ``[min_length, max_length]`` (``None``: no cap)."""

    name: str
    prefix: str
    min_length: int
    max_length: int | None

    def sample(self, rng: np.random.Generator, length: int) -> tuple[str, str]:
        """Return ``(prompt, reference_answer)`` drawn with ``rng`` only."""
        ...

    def max_answer_length(self, length: int) -> int:
        """The longest reference answer at ``length`` (sizes the static completion horizon)."""
        ...

    def max_prompt_length(self, length: int) -> int:
        """The longest prompt at ``length``, in characters (sizes the model's sequence)."""
        ...

    def verify(self, prompt: str, completion: str) -> bool:
        """Exactly judge ``completion`` (cut before the stop token) for ``prompt``."""
        ...


def _check_length(task: Task, length: object) -> int:
    if isinstance(length, bool) or not isinstance(length, int | np.integer):
        raise _error("length", f"be an int for task {task.name!r}", length)
    length = int(length)
    upper = task.max_length
    if length < task.min_length or (upper is not None and length > upper):
        bound = f"[{task.min_length}, {upper}]" if upper is not None else f">= {task.min_length}"
        within = "in " + bound if upper is not None else bound
        raise _error("length", f"be {within} for task {task.name!r}", length)
    return length


def _body(task: Task, prompt: object) -> str:
    """The text between ``"<prefix>:"`` and the final separator; raises naming `prompt`."""
    head = f"{task.prefix}:"
    if not (isinstance(prompt, str) and prompt.startswith(head) and prompt.endswith(SEPARATOR)):
        raise _error("prompt", f"read '{head}...{SEPARATOR}' for task {task.name!r}", prompt)
    return prompt[len(head) : -len(SEPARATOR)]


def _letters(rng: np.random.Generator, length: int) -> str:
    return "".join(_LETTERS[i] for i in rng.integers(0, len(_LETTERS), size=length))


class _LetterTask:
    """Shared shape of copy / reverse / sort: a string of letters and a function of it."""

    name: str = ""
    prefix: str = ""
    min_length: int = 1
    max_length: int | None = None
    _body_re = re.compile(r"[a-z]+")

    def _transform(self, text: str) -> str:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, length: int) -> tuple[str, str]:
        text = _letters(rng, _check_length(self, length))
        return f"{self.prefix}:{text}{SEPARATOR}", self._transform(text)

    def max_answer_length(self, length: int) -> int:
        return length

    def max_prompt_length(self, length: int) -> int:
        return len(self.prefix) + 1 + length + len(SEPARATOR)

    def verify(self, prompt: str, completion: str) -> bool:
        body = _body(self, prompt)
        if not self._body_re.fullmatch(body):
            raise _error("prompt", f"hold lowercase letters for task {self.name!r}", prompt)
        return isinstance(completion, str) and completion == self._transform(body)


class CopyTask(_LetterTask):
    """``copy:abc|`` -> ``abc``."""

    name = "copy"
    prefix = "copy"

    def _transform(self, text: str) -> str:
        return text


class ReverseTask(_LetterTask):
    """``reverse:abc|`` -> ``cba``."""

    name = "reverse"
    prefix = "reverse"

    def _transform(self, text: str) -> str:
        return text[::-1]


class SortTask(_LetterTask):
    """``sort:cab|`` -> ``abc`` (the letters in alphabetical order, repeats kept)."""

    name = "sort"
    prefix = "sort"

    def _transform(self, text: str) -> str:
        return "".join(sorted(text))


class AdditionTask:
    """``add:123+45|`` -> ``168``: decimal sum, no sign, no leading zeros.

    One operand has exactly ``length`` digits, the other 1..``length`` digits (order random);
    multi-digit operands have no leading zero.
    """

    name = "addition"
    prefix = "add"
    min_length = 1
    max_length: int | None = None
    _body_re = re.compile(r"(0|[1-9][0-9]*)\+(0|[1-9][0-9]*)")

    @staticmethod
    def _number(rng: np.random.Generator, digits: int) -> str:
        if digits == 1:
            return str(int(rng.integers(0, 10)))
        first = str(int(rng.integers(1, 10)))
        return first + "".join(str(d) for d in rng.integers(0, 10, size=digits - 1))

    def _write(self, total: int) -> str:
        """The answer text of the sum ``total``."""
        return str(total)

    def sample(self, rng: np.random.Generator, length: int) -> tuple[str, str]:
        length = _check_length(self, length)
        long = self._number(rng, length)
        short = self._number(rng, int(rng.integers(1, length + 1)))
        left, right = (long, short) if rng.integers(0, 2) == 0 else (short, long)
        return f"{self.prefix}:{left}+{right}{SEPARATOR}", self._write(int(left) + int(right))

    def max_answer_length(self, length: int) -> int:
        return length + 1

    def max_prompt_length(self, length: int) -> int:
        return len(self.prefix) + 1 + 2 * length + 1 + len(SEPARATOR)

    def verify(self, prompt: str, completion: str) -> bool:
        match = self._body_re.fullmatch(_body(self, prompt))
        if match is None:
            raise _error(
                "prompt", f"read '{self.prefix}:<int>+<int>|' for task {self.name!r}", prompt
            )
        expected = self._write(int(match.group(1)) + int(match.group(2)))
        return isinstance(completion, str) and completion == expected


class AdditionLsbTask(AdditionTask):
    """``addlsb:123+45|`` -> ``861``: the same sum written least significant digit first.

    The operands read as in ``addition``; only the answer's order differs, so a causal writer
    meets each carry before the digit it changes (``addition`` makes it resolve the whole
    carry chain before its first digit).
    """

    name = "addition_lsb"
    prefix = "addlsb"

    def _write(self, total: int) -> str:
        return str(total)[::-1]


class AgreeTask:
    """``agree:4|`` -> any one symbol of :data:`AGREE_SYMBOLS` repeated 4 times.

    The reference answer's symbol is drawn uniformly; :meth:`verify` accepts every symbol.
    """

    name = "agree"
    prefix = "agree"
    min_length = 1
    max_length: int | None = None
    symbols: str = AGREE_SYMBOLS
    _body_re = re.compile(r"[1-9][0-9]*")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[str, str]:
        length = _check_length(self, length)
        symbol = self.symbols[int(rng.integers(0, len(self.symbols)))]
        return f"{self.prefix}:{length}{SEPARATOR}", symbol * length

    def max_answer_length(self, length: int) -> int:
        return length

    def max_prompt_length(self, length: int) -> int:
        return len(self.prefix) + 1 + len(str(length)) + len(SEPARATOR)

    def verify(self, prompt: str, completion: str) -> bool:
        body = _body(self, prompt)
        if not self._body_re.fullmatch(body):
            raise _error("prompt", "read 'agree:<positive int>|' for task 'agree'", prompt)
        count = int(body)
        return (
            isinstance(completion, str)
            and len(completion) == count
            and completion[0] in self.symbols
            and completion == completion[0] * count
        )


@functools.cache
def _sudoku_solutions() -> tuple[str, ...]:
    """All 288 valid 4x4 grids (rows, columns and 2x2 boxes each hold 1-4), as 16-char strings,
    in lexicographic order (a backtracking fill, row-major, trying digits in increasing order)."""
    cells = [""] * _SUDOKU_CELLS
    peers = [[j for unit in _UNITS if i in unit for j in unit if j != i] for i in range(16)]
    grids: list[str] = []

    def fill(index: int) -> None:
        if index == _SUDOKU_CELLS:
            grids.append("".join(cells))
            return
        used = {cells[j] for j in peers[index]}
        for digit in _SUDOKU_DIGITS:
            if digit not in used:
                cells[index] = digit
                fill(index + 1)
        cells[index] = ""

    fill(0)
    return tuple(grids)


def _sudoku_units() -> list[list[int]]:
    n = _SUDOKU_SIZE
    rows = [[r * n + c for c in range(n)] for r in range(n)]
    cols = [[r * n + c for r in range(n)] for c in range(n)]
    boxes = [
        [(br + r) * n + bc + c for r in range(2) for c in range(2)]
        for br in (0, 2)
        for bc in (0, 2)
    ]
    return rows + cols + boxes


_UNITS = _sudoku_units()


def _sudoku_valid(grid: str) -> bool:
    """True iff the 16 cells fill every row, column and 2x2 box with 1-4 exactly once."""
    digits = set(_SUDOKU_DIGITS)
    return len(grid) == _SUDOKU_CELLS and all({grid[i] for i in unit} == digits for unit in _UNITS)


def _sudoku_format(cells: str) -> str:
    n = _SUDOKU_SIZE
    return _SUDOKU_ROW_SEP.join(cells[r * n : (r + 1) * n] for r in range(n))


class SudokuTask:
    """4x4 sudoku: ``sudoku:1?34,34?2,2143,4321|`` -> ``1234,3412,2143,4321``.

    Rows are written top to bottom, separated by ``','``, blanks as ``'?'``; the answer is the full
    grid in the same layout. Puzzles come from a uniformly drawn valid grid with ``length`` cells
    blanked, so at least one solution always exists; :meth:`verify` accepts any valid grid that
    keeps every given, so an under-determined puzzle has several correct answers.
    """

    name = "sudoku"
    prefix = "sudoku"
    min_length = 1
    max_length: int | None = _SUDOKU_CELLS
    _body_re = re.compile(r"[1-4?]{4}(,[1-4?]{4}){3}")
    _answer_re = re.compile(r"[1-4]{4}(,[1-4]{4}){3}")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[str, str]:
        length = _check_length(self, length)
        solutions = _sudoku_solutions()
        solution = solutions[int(rng.integers(0, len(solutions)))]
        blanks = set(rng.choice(_SUDOKU_CELLS, size=length, replace=False).tolist())
        puzzle = "".join(_SUDOKU_BLANK if i in blanks else c for i, c in enumerate(solution))
        return f"{self.prefix}:{_sudoku_format(puzzle)}{SEPARATOR}", _sudoku_format(solution)

    def givens(self, prompt: str) -> str:
        """The puzzle's 16 cells, row-major, blanks as ``'?'``; raises naming `prompt`."""
        body = _body(self, prompt)
        if not self._body_re.fullmatch(body):
            raise _error("prompt", "hold 4 rows of 4 cells (1-4 or '?') joined by ','", prompt)
        return body.replace(_SUDOKU_ROW_SEP, "")

    def solutions(self, prompt: str) -> list[str]:
        """Every correct answer for ``prompt`` (formatted like answers), in lexicographic order."""
        givens = self.givens(prompt)
        return [
            _sudoku_format(grid)
            for grid in _sudoku_solutions()
            if all(g in (_SUDOKU_BLANK, c) for g, c in zip(givens, grid, strict=True))
        ]

    def max_answer_length(self, length: int) -> int:
        return 19  # four rows of four digits and three commas

    def max_prompt_length(self, length: int) -> int:
        return len(self.prefix) + 1 + 19 + len(SEPARATOR)

    def verify(self, prompt: str, completion: str) -> bool:
        givens = self.givens(prompt)
        if not (isinstance(completion, str) and self._answer_re.fullmatch(completion)):
            return False
        grid = completion.replace(_SUDOKU_ROW_SEP, "")
        if not _sudoku_valid(grid):
            return False
        return all(g in (_SUDOKU_BLANK, c) for g, c in zip(givens, grid, strict=True))


#: Every task by name, in the order of ``distill.config.TaskName``.
TASKS: Mapping[str, Task] = {
    task.name: task
    for task in (
        CopyTask(),
        ReverseTask(),
        SortTask(),
        AdditionTask(),
        AdditionLsbTask(),
        AgreeTask(),
        SudokuTask(),
    )
}

_BY_PREFIX: Mapping[str, Task] = {task.prefix: task for task in TASKS.values()}


def get_task(name: str | Task, field: str = "task") -> Task:
    """The task named ``name`` (a :class:`Task` is returned as is); raises naming ``field``."""
    if isinstance(name, str):
        task = TASKS.get(name)
        if task is None:
            raise _error(field, f"be one of {', '.join(TASKS)}", name)
        return task
    if isinstance(name, Task):
        return name
    raise _error(field, "be a task name or a Task", name)


def task_for_prompt(prompt: str) -> Task:
    """The task a prompt belongs to, read from its ``"<prefix>:"``; raises naming `prompt`."""
    prefix = prompt.split(":", 1)[0] if isinstance(prompt, str) and ":" in prompt else None
    task = _BY_PREFIX.get(prefix) if prefix is not None else None
    if task is None:
        known = ", ".join(f"'{p}:'" for p in _BY_PREFIX)
        raise _error("prompt", f"start with a task prefix ({known})", prompt)
    return task


def verify(item: Example | tuple[str | Task, str] | str, completion: str) -> bool:
    """Judge ``completion`` for an :class:`Example`, a ``(task, prompt)`` pair (task by name or
    object) or a bare prompt (its task read from the prefix)."""
    if isinstance(item, Example):
        task, prompt = get_task(item.task), item.prompt
    elif isinstance(item, tuple) and len(item) == 2:
        task, prompt = get_task(item[0]), item[1]
    elif isinstance(item, str):
        task, prompt = task_for_prompt(item), item
    else:
        raise _error("item", "be an Example, a (task, prompt) pair or a prompt", item)
    if not isinstance(completion, str):
        raise _error("completion", "be a str", completion)
    return task.verify(prompt, completion)


def answer_horizon(tasks: Sequence[str], max_length: int) -> int:
    """Completion slots needed for any answer of ``tasks`` up to ``max_length`` plus a stop."""
    return 1 + max(get_task(name).max_answer_length(max_length) for name in tasks)


def max_sequence_length(tasks: Sequence[str], min_length: int, max_length: int) -> int:
    """The longest encoded row of a stream over ``tasks`` with lengths in
    ``[min_length, max_length]`` under a character tokenizer (one id per character): bos,
    the longest prompt, the longest answer and one stop id. A model whose ``max_length`` is
    below it cannot hold every row. Raises :class:`DataError` naming the field."""
    if isinstance(tasks, str) or not isinstance(tasks, Sequence) or not tasks:
        raise _error("tasks", "be a non-empty sequence of task names", tasks)
    for field, value in (("min_length", min_length), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise _error(field, "be an int >= 1", value)
    if min_length > max_length:
        raise _error("min_length", f"be <= max_length={max_length}", min_length)
    longest = 0
    for name in tasks:
        task = get_task(name, "tasks")
        _check_length(task, max_length)
        # Every length in the range, not only the largest: a prompt's digit count (agree) and
        # an answer's carry (addition) grow with length, but nothing promises monotonicity.
        for length in range(max(min_length, task.min_length), max_length + 1):
            row = 1 + task.max_prompt_length(length) + task.max_answer_length(length) + 1
            longest = max(longest, row)
    return longest


def check_position(position: object, limit: int | None) -> int:
    """A stream position: an int >= 0 and, with a ``limit``, below it (an exhausted stream
    is an error, never a wrap-around)."""
    if not isinstance(position, int | np.integer) or isinstance(position, bool):
        raise _error("position", "be an int", position)
    position = int(position)
    if position < 0:
        raise _error("position", "be >= 0", position)
    if limit is not None and position >= limit:
        raise _error("position", f"be < limit={limit} (the stream is exhausted)", position)
    return position
