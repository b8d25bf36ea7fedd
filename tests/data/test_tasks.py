"""Tests pinning the synthetic tasks and their exact verifiers (``distill.data.tasks``)."""

from __future__ import annotations

import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.config import TaskName
from distill.data.tasks import (
    AGREE_SYMBOLS,
    SEPARATOR,
    TASKS,
    DataError,
    Example,
    SudokuTask,
    _sudoku_solutions,
    get_task,
    task_for_prompt,
    verify,
)
from distill.tokenizer import DEFAULT_ALPHABET, CharTokenizer

ALPHABET = set(DEFAULT_ALPHABET)
TOKENIZER = CharTokenizer()


def _lengths(name: str) -> list[int]:
    upper = TASKS[name].max_length or 12
    return sorted({1, 2, 3, min(7, upper), upper})


def _samples(name: str, seeds: int = 5) -> list[tuple[str, str]]:
    return [
        TASKS[name].sample(np.random.default_rng([seed, length]), length)
        for length in _lengths(name)
        for seed in range(seeds)
    ]


def test_registry_matches_the_config_task_names() -> None:
    assert tuple(TASKS) == typing.get_args(TaskName)
    for name, task in TASKS.items():
        assert task.name == name
        assert get_task(name) is task
        assert get_task(task) is task


@pytest.mark.parametrize("name", list(TASKS))
def test_reference_answers_verify_and_use_only_the_alphabet(name: str) -> None:
    task = TASKS[name]
    for prompt, answer in _samples(name):
        assert prompt.startswith(f"{task.prefix}:")
        assert prompt.endswith(SEPARATOR) and prompt.count(SEPARATOR) == 1
        assert set(prompt) <= ALPHABET and set(answer) <= ALPHABET
        TOKENIZER.encode(prompt + answer)  # never raises
        assert task.verify(prompt, answer)
        assert verify((name, prompt), answer)
        assert verify(prompt, answer)
        assert task_for_prompt(prompt) is task


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(list(TASKS)),
    seed=st.integers(0, 2**63 - 1),
    length=st.integers(1, 16),
)
def test_reference_answers_verify_for_any_seed(name: str, seed: int, length: int) -> None:
    prompt, answer = TASKS[name].sample(np.random.default_rng(seed), length)
    assert set(prompt + answer) <= ALPHABET
    assert TASKS[name].verify(prompt, answer)


def test_sampling_is_a_function_of_the_generator_only() -> None:
    for name, task in TASKS.items():
        first = task.sample(np.random.default_rng(7), 3)
        again = task.sample(np.random.default_rng(7), 3)
        assert first == again, name


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "addition", "addition_lsb"])
def test_typical_wrong_answers_are_rejected(name: str) -> None:
    task = TASKS[name]
    for prompt, answer in _samples(name):
        wrong = {
            answer[:-1],  # too short
            answer + answer[-1],  # extra character
            "x" + answer,
            answer + " ",  # nothing is stripped
            answer + "\n",
            " " + answer,
            "",
            answer[::-1] + "a",
        }
        if name == "addition":
            value = int(answer)
            wrong |= {str(value + 1), str(value - 1), "0" + answer, "+" + answer, str(value + 10)}
        elif name == "addition_lsb":
            value = int(answer[::-1])
            wrong |= {str(value + 1)[::-1], answer + "0", "+" + answer, answer[::-1] + "x"}
        else:
            # change one letter
            swapped = ("b" if answer[0] == "a" else "a") + answer[1:]
            wrong.add(swapped)
        wrong.discard(answer)
        for completion in wrong:
            assert not task.verify(prompt, completion), (prompt, completion)


def test_letter_tasks_known_cases() -> None:
    assert TASKS["copy"].sample(np.random.default_rng(0), 3)[0].startswith("copy:")
    assert TASKS["copy"].verify("copy:abc|", "abc")
    assert not TASKS["copy"].verify("copy:abc|", "cba")
    assert TASKS["reverse"].verify("reverse:abc|", "cba")
    assert not TASKS["reverse"].verify("reverse:abc|", "abc")
    assert TASKS["sort"].verify("sort:cabca|", "aabcc")
    assert not TASKS["sort"].verify("sort:cabca|", "abc")  # repeats are kept
    assert not TASKS["sort"].verify("sort:cabca|", "ccbaa")


def test_addition_known_cases() -> None:
    task = TASKS["addition"]
    assert task.verify("add:123+45|", "168")
    assert task.verify("add:999+1|", "1000")
    assert task.verify("add:0+0|", "0")
    assert not task.verify("add:0+0|", "00")
    assert not task.verify("add:123+45|", "0168")
    assert not task.verify("add:123+45|", "167")


def test_addition_lsb_writes_the_same_sum_lowest_digit_first() -> None:
    task = TASKS["addition_lsb"]
    assert task.verify("addlsb:123+45|", "861")
    assert task.verify("addlsb:999+1|", "0001")
    assert task.verify("addlsb:0+0|", "0")
    assert not task.verify("addlsb:123+45|", "168")  # the plain order is wrong here
    assert not task.verify("addlsb:999+1|", "1")
    for seed in range(20):
        rng = np.random.default_rng(seed)
        prompt, answer = task.sample(rng, 5)
        plain_prompt, plain_answer = TASKS["addition"].sample(np.random.default_rng(seed), 5)
        assert prompt == "addlsb:" + plain_prompt.removeprefix("add:")
        assert answer == plain_answer[::-1]
    with pytest.raises(DataError, match="^`prompt` must read 'addlsb:"):
        task.verify("add:1+2|", "3")  # the plain task's prompt
    with pytest.raises(DataError, match=r"^`prompt` must read 'addlsb:<int>\+<int>\|'"):
        task.verify("addlsb:1+|", "1")


def test_addition_operands_have_the_requested_digits() -> None:
    for seed in range(50):
        prompt, _ = TASKS["addition"].sample(np.random.default_rng(seed), 4)
        left, right = prompt.removeprefix("add:").removesuffix("|").split("+")
        assert max(len(left), len(right)) == 4
        assert all(len(op) == 1 or op[0] != "0" for op in (left, right))


def test_agree_accepts_every_symbol_and_rejects_mixtures() -> None:
    task = TASKS["agree"]
    assert len(AGREE_SYMBOLS) == 8 and set(AGREE_SYMBOLS) <= ALPHABET
    for k in (1, 2, 4, 9):
        prompt = f"agree:{k}|"
        for symbol in AGREE_SYMBOLS:
            assert task.verify(prompt, symbol * k)
        mixed = AGREE_SYMBOLS[0] * (k - 1) + AGREE_SYMBOLS[1]
        wrong = {
            mixed if k > 1 else "",
            AGREE_SYMBOLS[0] * (k + 1),
            AGREE_SYMBOLS[0] * (k - 1),
            "z" * k,  # outside the set
            "1" * k,
            "",
        }
        for completion in wrong:
            assert not task.verify(prompt, completion), (prompt, completion)


def test_agree_reference_symbols_cover_the_set() -> None:
    seen = {TASKS["agree"].sample(np.random.default_rng(s), 3)[1][0] for s in range(200)}
    assert seen == set(AGREE_SYMBOLS)


def test_there_are_288_valid_sudoku_grids() -> None:
    grids = _sudoku_solutions()
    assert len(grids) == len(set(grids)) == 288


def test_sudoku_puzzles_are_solvable_and_keep_their_givens() -> None:
    task: SudokuTask = TASKS["sudoku"]  # type: ignore[assignment]
    for blanks in range(1, 17):
        for seed in range(5):
            prompt, answer = task.sample(np.random.default_rng([seed, blanks]), blanks)
            givens = task.givens(prompt)
            assert givens.count("?") == blanks
            solutions = task.solutions(prompt)
            assert answer in solutions
            for solution in solutions:
                assert task.verify(prompt, solution)
    # A single blank is always determined; sixteen blanks admit every valid grid.
    prompt, _ = task.sample(np.random.default_rng(0), 1)
    assert len(task.solutions(prompt)) == 1
    prompt, _ = task.sample(np.random.default_rng(0), 16)
    assert prompt == "sudoku:????,????,????,????|"
    assert len(task.solutions(prompt)) == 288


def test_sudoku_rejects_invalid_and_inconsistent_grids() -> None:
    task = TASKS["sudoku"]
    prompt = "sudoku:1?34,34?2,2143,4321|"
    assert task.verify(prompt, "1234,3412,2143,4321")
    rejected = [
        "1234,3412,2143,4312",  # last row breaks its columns
        "1234,3412,2143,432",  # too short
        "1234,3412,2143,43211",  # too long
        "1234,3412,2143,4321,",  # trailing separator
        "1234341221434321",  # no separators
        "1234;3412;2143;4321",  # wrong separator
        "1234,3412,2143,4321\n",
        "1?34,34?2,2143,4321",  # blanks left in
        "1234,1234,1234,1234",  # rows fine, columns not
        "",
    ]
    for completion in rejected:
        assert not task.verify(prompt, completion), completion
    # A valid grid that contradicts a given.
    grids = _sudoku_solutions()
    other = next(g for g in grids if g[0] != "1")
    completion = ",".join(other[i : i + 4] for i in range(0, 16, 4))
    assert not task.verify(prompt, completion)
    assert task.verify("sudoku:????,????,????,????|", completion)


def test_verify_accepts_examples_pairs_and_bare_prompts() -> None:
    example = Example(task="copy", prompt="copy:ab|", answer="ab", index=0)
    assert verify(example, "ab") and not verify(example, "ba")
    assert verify(("copy", "copy:ab|"), "ab")
    assert verify((TASKS["copy"], "copy:ab|"), "ab")
    assert verify("copy:ab|", "ab")


def test_malformed_prompts_raise_naming_prompt() -> None:
    with pytest.raises(DataError, match=r"^`prompt` must"):
        TASKS["copy"].verify("reverse:ab|", "ba")
    with pytest.raises(DataError, match=r"^`prompt` must"):
        TASKS["copy"].verify("copy:ab", "ab")  # no separator
    with pytest.raises(DataError, match=r"^`prompt` must"):
        TASKS["addition"].verify("add:1+|", "1")
    with pytest.raises(DataError, match=r"^`prompt` must"):
        TASKS["sudoku"].verify("sudoku:1234|", "1234")
    with pytest.raises(DataError, match=r"^`prompt` must start with a task prefix"):
        verify("nope:ab|", "ab")
    with pytest.raises(DataError, match=r"^`task` must be one of"):
        verify(("nope", "copy:ab|"), "ab")
    with pytest.raises(DataError, match=r"^`completion` must be a str"):
        verify("copy:ab|", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "length"), [("copy", 0), ("addition", 0), ("agree", -1), ("sudoku", 17)]
)
def test_lengths_outside_a_tasks_range_raise_naming_length(name: str, length: int) -> None:
    with pytest.raises(DataError, match=rf"^`length` must be .* for task '{name}'; received"):
        TASKS[name].sample(np.random.default_rng(0), length)
