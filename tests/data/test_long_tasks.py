"""The long task specs of issue 16: copy, reverse, sort and addition at 16-32 tokens and
``agree`` at 16 letters, as streams and as the job configs ``deploy/configs/agree16.yaml``
and ``deploy/configs/long-tasks.yaml`` (answers verify, rows fit the configured models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distill.config import JobConfig, load_config
from distill.data.stream import TaskStream, encode_example
from distill.data.tasks import TASKS, DataError, max_sequence_length, verify
from distill.job import completion_length, job_tokenizer
from services.common.config import JobSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("agree16.yaml", "long-tasks.yaml")


def _job(name: str) -> JobConfig:
    return load_config(ROOT / "deploy" / "configs" / name, JobConfig)


@pytest.mark.parametrize("task", ["copy", "reverse", "sort", "addition", "addition_lsb"])
def test_long_deterministic_tasks_give_16_to_33_token_answers_that_verify(task):
    stream = TaskStream(tasks=[task], seed=5, min_length=16, max_length=32, batch_size=8)
    lengths = set()
    for example in stream.batch(0, 200):
        assert verify(example, example.answer)
        assert not verify(example, example.answer[::-1] + "x")
        lengths.add(len(example.answer))
    # Letters: 16..32 (all seen); addition: 16..33 digits (a carry adds one).
    assert min(lengths) == 16 and 32 <= max(lengths) <= 33


def test_agree_at_16_letters_verifies_every_symbol_and_nothing_shorter():
    stream = TaskStream(tasks=["agree"], seed=0, min_length=16, max_length=16)
    example = stream.example(0)
    assert example.prompt == "agree:16|" and len(example.answer) == 16
    for symbol in "abcdefgh":
        assert verify(example, symbol * 16)
    assert not verify(example, "a" * 15)
    assert not verify(example, "a" * 15 + "b")


@pytest.mark.parametrize("name", list(TASKS))
def test_max_prompt_length_bounds_every_prompt_and_is_reached(name):
    task = TASKS[name]
    upper = task.max_length or 40
    for length in (task.min_length, min(16, upper), upper):
        prompts = [
            task.sample(np.random.default_rng([seed, length]), length)[0] for seed in range(40)
        ]
        assert max(len(p) for p in prompts) <= task.max_prompt_length(length)
        if not name.startswith("addition"):  # the shorter operand is rarely as long as the other
            assert max(len(p) for p in prompts) == task.max_prompt_length(length)


def test_max_sequence_length_is_the_longest_encoded_row():
    # add:<32 digits>+<32 digits>| is 70 characters; bos, 33 answer digits and a stop.
    assert max_sequence_length(["addition"], 16, 32) == 1 + 70 + 33 + 1
    assert max_sequence_length(["agree"], 16, 16) == 1 + 9 + 16 + 1
    assert max_sequence_length(["copy", "agree"], 2, 6) == 1 + len("copy:abcdef|") + 6 + 1
    with pytest.raises(DataError, match="`min_length` must"):
        max_sequence_length(["copy"], 5, 4)
    with pytest.raises(DataError, match="`length` must"):
        max_sequence_length(["sudoku"], 1, 17)
    with pytest.raises(DataError, match="`tasks` must"):
        max_sequence_length(["chess"], 1, 2)


@pytest.mark.parametrize("name", CONFIGS)
def test_long_job_configs_load_and_pass_the_job_checks(name):
    job = _job(name)
    load_config(ROOT / "deploy" / "configs" / name, JobSpec)  # as the services load it
    tokenizer = job_tokenizer(job)  # vocabulary matches teacher and student
    assert job.student.block_size == 16  # the schedule rule can reach 16 tokens per forward
    assert job.rollout.commit_rule == "threshold" and job.rollout.threshold == 0.9
    assert tokenizer.vocab_size == job.student.vocab_size


@pytest.mark.parametrize("name", CONFIGS)
def test_encoded_rows_of_the_long_configs_fit_their_models(name):
    job = _job(name)
    tokenizer = job_tokenizer(job)
    bound = max_sequence_length(job.data.tasks, job.data.min_length, job.data.max_length)
    assert bound <= job.student.max_length and bound <= job.teacher.max_length
    horizon = completion_length(job)
    longest = 0
    for split in ("train", "eval"):
        for example in TaskStream(job.data, split=split).batch(0, 256):
            prompt, answer = encode_example(example, tokenizer)
            assert len(answer) <= horizon
            longest = max(longest, len(prompt) + len(answer))
    assert longest <= bound
    assert horizon >= 17  # 16+ answer tokens and the stop
