"""Tests pinning the deterministic, resumable task streams (``distill.data.stream``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.config import ConfigError, DataConfig
from distill.data.stream import STREAM_FORMAT, TaskStream, encode_example
from distill.data.tasks import TASKS, DataError, Example, verify
from distill.tokenizer import DEFAULT_ALPHABET, CharTokenizer

ALL_TASKS = tuple(TASKS)


def _stream(**kwargs: object) -> TaskStream:
    defaults: dict[str, object] = {"tasks": ALL_TASKS, "seed": 3, "min_length": 1, "max_length": 8}
    defaults.update(kwargs)
    return TaskStream(**defaults)  # type: ignore[arg-type]


def test_position_is_identical_across_stream_objects() -> None:
    one, two = _stream(), _stream()
    for k in (0, 1, 5, 17, 10_000, 2**40):
        assert one.example(k) == two.example(k)
        assert one.example(k).index == k


def test_position_does_not_depend_on_access_order() -> None:
    forward, backward = _stream(), _stream()
    a5, a3 = forward.example(5), forward.example(3)
    b3, b5 = backward.example(3), backward.example(5)
    assert (a3, a5) == (b3, b5)
    # Reading many other positions in between changes nothing either.
    for k in range(50):
        forward.example(k)
    assert forward.example(5) == a5


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), position=st.integers(0, 2**48))
def test_every_example_verifies_and_uses_the_alphabet(seed: int, position: int) -> None:
    example = _stream(seed=seed).example(position)
    assert example.task in ALL_TASKS
    assert set(example.prompt + example.answer) <= set(DEFAULT_ALPHABET)
    assert verify(example, example.answer)


def test_pinned_examples() -> None:
    # Pinned: a change means the stream format changed, so bump STREAM_FORMAT deliberately.
    # The task list is spelled out: a task added to the registry is not a format change.
    pinned_tasks = ("copy", "reverse", "sort", "addition", "agree", "sudoku")
    stream = TaskStream(tasks=pinned_tasks, seed=0, min_length=1, max_length=8)
    assert stream.example(0) == Example(
        "sudoku", "sudoku:????,2431,1342,42??|", "3124,2431,1342,4213", 0
    )
    assert stream.example(2) == Example("reverse", "reverse:jlpsn|", "nsplj", 2)
    assert stream.example(3) == Example("agree", "agree:7|", "hhhhhhh", 3)
    assert stream.example(8) == Example("addition", "add:74+4|", "78", 8)
    assert STREAM_FORMAT == "distill.data.TaskStream/v1"


def test_mixture_covers_every_task_and_length() -> None:
    examples = _stream().batch(0, 600)
    assert {e.task for e in examples} == set(ALL_TASKS)
    agree_lengths = {len(e.answer) for e in examples if e.task == "agree"}
    assert agree_lengths == set(range(1, 9))


def test_batch_and_iterators_agree_with_example() -> None:
    stream = _stream()
    batch = stream.batch(10, 4)
    assert batch == [stream.example(k) for k in range(10, 14)]
    it = stream.iter_from(10)
    assert [next(it) for _ in range(4)] == batch
    assert stream.batch(10, 0) == []
    sized = _stream(batch_size=3)
    assert sized.batch(6) == sized.step_batch(2) == [sized.example(k) for k in (6, 7, 8)]


def test_train_and_eval_splits_differ() -> None:
    train, evaluation = _stream(split="train"), _stream(split="eval")
    train_examples = train.batch(0, 100)
    eval_examples = evaluation.batch(0, 100)
    assert train_examples != eval_examples
    different = sum(t != e for t, e in zip(train_examples, eval_examples, strict=True))
    assert different > 90
    # Prompts from a large instance space never coincide.
    big = {e.prompt for e in _stream(tasks=("copy",), min_length=8).batch(0, 200)}
    big_eval = {
        e.prompt for e in _stream(tasks=("copy",), min_length=8, split="eval").batch(0, 200)
    }
    assert not big & big_eval


def test_the_validation_split_is_held_out_from_train_and_eval() -> None:
    prompts = {
        split: {e.prompt for e in _stream(tasks=("copy",), min_length=8, split=split).batch(0, 200)}
        for split in ("train", "eval", "validation")
    }
    assert not prompts["validation"] & prompts["train"]
    assert not prompts["validation"] & prompts["eval"]
    held = _stream(split="validation")
    assert TaskStream.from_spec(held.stream_spec()).batch(0, 5) == held.batch(0, 5)


def test_seeds_give_different_streams() -> None:
    assert _stream(seed=0).batch(0, 20) != _stream(seed=1).batch(0, 20)


def test_exhausted_stream_raises_naming_position() -> None:
    stream = _stream(limit=5)
    assert len(stream) == 5
    stream.example(4)
    with pytest.raises(DataError, match=r"^`position` must be < limit=5 .*; received 5$"):
        stream.example(5)
    with pytest.raises(DataError, match=r"^`position` must be < limit=5"):
        stream.batch(3, 3)  # would run past the end: no silent wrap-around
    assert list(stream) == stream.batch(0, 5)
    assert list(stream.iter_from(3)) == stream.batch(3, 2)
    with pytest.raises(DataError, match=r"^`position` must be >= 0"):
        stream.example(-1)
    with pytest.raises(DataError, match=r"^`position` must be an int"):
        stream.example(1.0)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"^`limit` must be set"):
        len(_stream())


def test_built_from_a_data_config_with_overrides() -> None:
    config = DataConfig(tasks=("copy", "sort"), seed=9, batch_size=4, min_length=2, max_length=5)
    stream = TaskStream(config)
    assert stream.tasks == ("copy", "sort")
    assert (stream.seed, stream.batch_size, stream.min_length, stream.max_length) == (9, 4, 2, 5)
    assert stream.batch(0) == TaskStream(
        tasks=["copy", "sort"], seed=9, batch_size=4, min_length=2, max_length=5
    ).batch(0)
    longer = TaskStream(config, max_length=9, split="eval")
    assert (longer.max_length, longer.split, longer.seed) == (9, "eval", 9)
    default = TaskStream()
    assert default.tasks == DataConfig().tasks


def test_spec_round_trips_through_json() -> None:
    stream = _stream(split="eval", limit=50, batch_size=2)
    spec = json.loads(json.dumps(stream.stream_spec()))
    assert spec["format"] == STREAM_FORMAT
    assert spec["tasks"] == list(ALL_TASKS)
    rebuilt = TaskStream.from_spec(spec)
    assert rebuilt.stream_spec() == stream.stream_spec()
    assert rebuilt.batch(40, 10) == stream.batch(40, 10)
    with pytest.raises(DataError, match=r"^`spec.format` must be"):
        TaskStream.from_spec({**spec, "format": "distill.data.TaskStream/v0"})
    with pytest.raises(DataError, match=r"^`spec` must have exactly the keys"):
        TaskStream.from_spec({**spec, "extra": 1})


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tasks": ("copy", "nope")}, r"^`tasks` must name only known tasks .*; received 'nope'"),
        ({"tasks": ()}, r"^`tasks` must name at least one task"),
        ({"tasks": "copy"}, r"^`tasks` must be a sequence"),
        ({"tasks": ("copy", "copy")}, r"^`tasks` must not repeat a task"),
        ({"min_length": 5, "max_length": 4}, r"^`min_length` must be <= max_length=4; received 5"),
        ({"tasks": ("addition",), "min_length": 0}, r"^`min_length` must be >= 1 for task"),
        ({"tasks": ("sudoku",), "max_length": 17}, r"^`max_length` must be <= 16 for task"),
        ({"seed": -1}, r"^`seed` must be >= 0"),
        ({"seed": 1.5}, r"^`seed` must be an int"),
        ({"batch_size": 0}, r"^`batch_size` must be >= 1"),
        ({"split": "test"}, r"^`split` must be one of train, eval, validation"),
        ({"limit": -1}, r"^`limit` must be None or an int >= 0"),
    ],
)
def test_bad_arguments_fail_naming_the_field(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        _stream(**kwargs)


def test_bad_data_configs_fail_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"`data.tasks.1`"):
        DataConfig(tasks=("copy", "nope"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"`data.min_length` must be <= max_length"):
        DataConfig(min_length=5, max_length=4)
    # Valid for the config, invalid for a task: the stream names the field.
    with pytest.raises(DataError, match=r"^`max_length` must be <= 16 for task 'sudoku'"):
        TaskStream(DataConfig(tasks=("sudoku",), max_length=20))
    with pytest.raises(DataError, match=r"^`config` must be a DataConfig"):
        TaskStream({"tasks": ("copy",)})  # type: ignore[arg-type]


def test_encode_example_puts_bos_first_and_the_stop_id_last() -> None:
    tokenizer = CharTokenizer()
    for example in _stream().batch(0, 50):
        prompt_ids, answer_ids = encode_example(example, tokenizer)
        assert prompt_ids[0] == tokenizer.special.bos_id
        assert answer_ids[-1] == tokenizer.special.stop_ids[0]
        assert len(prompt_ids) == len(example.prompt) + 1
        assert len(answer_ids) == len(example.answer) + 1
        assert tokenizer.decode(prompt_ids) == example.prompt
        assert tokenizer.decode(answer_ids) == example.answer
        assert tokenizer.special.stop_ids[0] not in prompt_ids + answer_ids[:-1]
    with pytest.raises(DataError, match=r"^`example` must be an Example"):
        encode_example(("copy:a|", "a"), tokenizer)  # type: ignore[arg-type]
